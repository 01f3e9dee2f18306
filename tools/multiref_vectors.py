#!/usr/bin/env python3
"""Makes the multi-reference sample that evalfleet's end-to-end scoring test
reads, and the figures the reference tools compute for it.

    python3 tools/multiref_vectors.py DEV_V2_JSON PREDICTIONS_JSON SQUAD_EVAL_V11 \
        crates/evalfleet/tests/data/squad2-dev-sample

Inputs (none of them is copied into the repository but the sample's data):
- DEV_V2_JSON: SQuAD 2.0's dev set (dev-v2.0.json), or a file holding its
  first articles; the sample takes the answerable questions of the first
  five articles (Normans ... Victoria_(Australia)), each with every
  reference answer its annotators gave.
- PREDICTIONS_JSON: published predictions of a strong reader on that dev set
  (question id -> answer text): the SQuAD 2.0 leaderboard's
  "BERT (single model) (Google AI Language)" file.
- SQUAD_EVAL_V11: the official SQuAD v1.1 evaluation script
  (evaluate-v1.1.py), run on the sample as it is meant to be run, and
  imported for its per-question exact match and F1.
- the `anls` package (pip install anls==0.0.2) for ANLS over the same
  references, DocVQA's measure (threshold 0.5).

Writes OUT.jsonl (one question a line: id, title, question, answers,
prediction) and OUT.expected.json (what the tools computed: totals and each
question's figures).
"""

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile

from anls import anls_score

ARTICLES = 5


def main():
    dev_path, predictions_path, script, out = sys.argv[1:5]
    with open(dev_path, encoding="utf-8") as f:
        dev = json.load(f)
    with open(predictions_path, encoding="utf-8") as f:
        predictions = json.load(f)
    articles = dev["data"][:ARTICLES]
    sample = []
    v11 = []
    for article in articles:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            qas = []
            for qa in paragraph["qas"]:
                if not qa["answers"]:
                    continue
                answers = [a["text"] for a in qa["answers"]]
                sample.append(
                    {
                        "id": qa["id"],
                        "title": article["title"],
                        "question": qa["question"],
                        "answers": answers,
                        "prediction": predictions[qa["id"]],
                    }
                )
                qas.append({"id": qa["id"], "question": qa["question"], "answers": qa["answers"]})
            if qas:
                paragraphs.append({"context": paragraph["context"], "qas": qas})
        v11.append({"title": article["title"], "paragraphs": paragraphs})

    spec = importlib.util.spec_from_file_location("squad_eval", script)
    squad = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(squad)

    # The official script, run as a command on the sample in its own format.
    with tempfile.TemporaryDirectory() as tmp:
        data_file = f"{tmp}/dev.json"
        pred_file = f"{tmp}/predictions.json"
        with open(data_file, "w", encoding="utf-8") as f:
            json.dump({"version": "1.1", "data": v11}, f)
        with open(pred_file, "w", encoding="utf-8") as f:
            json.dump({q["id"]: q["prediction"] for q in sample}, f)
        ran = subprocess.run(
            [sys.executable, script, data_file, pred_file],
            check=True,
            capture_output=True,
            text=True,
        )
        official = json.loads(ran.stdout.strip().splitlines()[-1])

    items = {}
    for q in sample:
        p, refs = q["prediction"], q["answers"]
        items[q["id"]] = {
            "exact_match": float(squad.metric_max_over_ground_truths(squad.exact_match_score, p, refs)),
            "f1": float(squad.metric_max_over_ground_truths(squad.f1_score, p, refs)),
            "anls": float(anls_score(prediction=p, gold_labels=refs, threshold=0.5)),
        }
    n = len(sample)
    expected = {
        "source": {
            "data": "SQuAD 2.0 dev set, answerable questions of its first %d articles (CC BY-SA 4.0)" % ARTICLES,
            "predictions": "SQuAD 2.0 leaderboard: BERT (single model) (Google AI Language)",
        },
        "tools": {
            "squad": "official SQuAD v1.1 evaluate-v1.1.py",
            "anls": importlib.metadata.version("anls"),
        },
        "questions": n,
        "with_several_distinct_answers": sum(1 for q in sample if len(set(q["answers"])) > 1),
        "official_v1_1": official,
        "anls": sum(i["anls"] for i in items.values()) / n,
        "items": items,
    }
    with open(out + ".jsonl", "w", encoding="utf-8") as f:
        for q in sample:
            f.write(json.dumps(q, ensure_ascii=False) + "\n")
    with open(out + ".expected.json", "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(json.dumps({k: v for k, v in expected.items() if k != "items"}, indent=1))


if __name__ == "__main__":
    main()
