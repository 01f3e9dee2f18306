#!/usr/bin/env python3
"""Makes the image example: text pages rendered as PNG, a scanned-looking
JPEG, a two-page PDF, the dataset that names them (with their text and
document type) and the mock's script, which answers each image by the
SHA-256 of its bytes with its text.

The files it makes are committed beside it; run it again only to change
them. It needs Pillow and poppler's pdftoppm (the PDF's pages are hashed as
evalfleet renders them: PNG at 150 dpi; another poppler version may render
other bytes, and then the mock answers the PDF's pages with its default
reply until this script is run again):

    python3 -m venv /tmp/pillow && /tmp/pillow/bin/pip install pillow
    /tmp/pillow/bin/python examples/images/make_images.py
"""
import hashlib
import json
import pathlib
import random
import subprocess
import tempfile

from PIL import Image, ImageDraw, ImageFilter, ImageFont

HERE = pathlib.Path(__file__).resolve().parent


def page(lines, size=(520, 220), font_size=26):
    """A white page with `lines` of black text."""
    image = Image.new("L", size, 255)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    for i, line in enumerate(lines):
        draw.text((24, 20 + i * (font_size + 12)), line, fill=0, font=font)
    return image


def scanned(image, seed):
    """`image` as a scanner gives it: tilted, blurred, grainy, greyish."""
    rng = random.Random(seed)
    tilted = image.rotate(1.2, resample=Image.BICUBIC, expand=True, fillcolor=235)
    soft = tilted.filter(ImageFilter.GaussianBlur(0.7))
    pixels = soft.load()
    for y in range(soft.height):
        for x in range(soft.width):
            pixels[x, y] = max(0, min(255, int(pixels[x, y] * 0.9) + rng.randint(-14, 14)))
    return soft


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def rendered_pages(pdf, count):
    """The PNG bytes of each page as evalfleet renders them by default."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(1, count + 1):
            prefix = pathlib.Path(tmp) / f"p{n}"
            subprocess.run(
                ["pdftoppm", "-png", "-r", "150", "-f", str(n), "-l", str(n), str(pdf), str(prefix)],
                check=True,
            )
            (only,) = pathlib.Path(tmp).glob(f"p{n}-*.png")
            out.append(only.read_bytes())
    return out


def main():
    (HERE / "pages").mkdir(exist_ok=True)
    documents = []  # (id, file, text, doc_type, [image bytes as sent])

    invoice = ["INVOICE 1042", "Acme Tools Ltd", "Total: 118.40 EUR"]
    path = HERE / "pages" / "invoice.png"
    page(invoice).save(path, optimize=True)
    documents.append(("invoice-1042", "pages/invoice.png", "\n".join(invoice), "invoice", [path.read_bytes()]))

    letter = ["Dear Ms Rivera,", "your order has shipped.", "Kind regards, Acme"]
    path = HERE / "pages" / "letter.png"
    page(letter).save(path, optimize=True)
    documents.append(("letter-7", "pages/letter.png", "\n".join(letter), "letter", [path.read_bytes()]))

    receipt = ["CORNER CAFE", "2 x espresso  5.00", "PAID"]
    path = HERE / "receipt.jpg"
    scanned(page(receipt), seed=7).save(path, quality=55)
    documents.append(("receipt-3", "receipt.jpg", "\n".join(receipt), "receipt", [path.read_bytes()]))

    report = [["QUARTERLY REPORT", "Page 1: sales rose 4%"], ["Page 2: costs fell 2%", "End of report"]]
    path = HERE / "report.pdf"
    first, second = (page(lines).convert("RGB") for lines in report)
    first.save(path, save_all=True, append_images=[second], resolution=100)
    text = "\n".join("\n".join(lines) for lines in report)
    documents.append(("report-q3", "report.pdf", text, "report", rendered_pages(path, 2)))

    with open(HERE / "documents.jsonl", "w") as out:
        for id_, file, text, doc_type, _ in documents:
            out.write(json.dumps({"id": id_, "image": file, "text": text, "doc_type": doc_type}) + "\n")
    # Each image answered with its own text: a page's lines for a PDF page
    # (the mock joins the replies of a request's images with newlines).
    with open(HERE / "answers.jsonl", "w") as out:
        for _, file, text, _, images in documents:
            replies = [text] if len(images) == 1 else ["\n".join(lines) for lines in report]
            for data, reply in zip(images, replies):
                out.write(json.dumps({"image": sha256(data), "replies": [reply]}) + "\n")
    total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
    print(f"{len(documents)} documents, {total} bytes in {HERE}")


if __name__ == "__main__":
    main()
