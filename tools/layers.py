#!/usr/bin/env python3
"""Checks that the modules of evalfleet's crates import only from their own
layer or the layers below it, as docs/architecture.md draws them.

A module is a file or folder directly under a crate's src/; it imports N when
one of its files (outside #[cfg(test)]) names `crate::N`. The layers of each
crate are listed below, lowest first. A module missing from the table, or an
import that points up, fails the check (exit 1) with the offending file.
Circles within a layer are ../shared/tools/module_cycles.py's business.

    python3 tools/layers.py [ROOT]
"""
import pathlib
import re
import sys

LAYERS = {
    "evalfleet-core": [
        # What an answer is worth, and the cache's keys: pure functions.
        ["eval", "cache", "jinja"],
        # The validated config.
        ["config"],
        # Datasets, templates, and what determines a run's results.
        ["dataset", "template", "fingerprint", "preflight", "images"],
        # The store's traits.
        ["store"],
        # The OpenAI client.
        ["client"],
        # Endpoints, limits, health, the one call path; workers of a run.
        ["fleet", "worker"],
        # Agents' calls (an OpenAI-compatible API, per item) over the one
        # call path.
        ["gateway"],
        # One module per kind of task; the outside metric backends they
        # wait on.
        ["task", "metric_backend"],
        # Drives items through their task's steps.
        ["pipeline"],
        # Creating, resuming and finishing runs; reports; benchmark
        # matrices above runs.
        # Google Sheets as a dataset and as the results' place: read before
        # a run, written from its committed results.
        ["run", "report", "rescore", "view", "bench", "sheets"],
    ],
    "evalfleet": [
        ["cli", "ui", "fleet"],
        ["commands"],
    ],
    "evalfleet-server": [
        # What a request gets when it fails; what the server may ask of
        # runs; digests of keys; the names the server answers to.
        ["error", "control", "extract", "keys", "hosts"],
        # The gateway's routes, which carry their own credentials (items'
        # tokens).
        ["gateway"],
        # Shared state, and who may ask.
        ["state", "auth"],
        # The JSON API, and the dashboard's pages.
        ["api", "pages", "metrics", "env"],
    ],
}

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
bad = []
for crate, layers in LAYERS.items():
    src = root / "crates" / crate / "src"
    level = {m: i for i, layer in enumerate(layers) for m in layer}
    mods = {p.stem if p.is_file() else p.name for p in src.iterdir() if p.suffix == ".rs" or p.is_dir()}
    mods -= {"lib", "main"}
    for m in sorted(mods - set(level)):
        bad.append(f"{crate}: module '{m}' is in no layer (add it to tools/layers.py)")
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).parts
        m = rel[0][:-3] if len(rel) == 1 else rel[0]
        if m not in level:
            continue
        text = re.sub(r"#\[cfg\(test\)\][\s\S]*", "", f.read_text(errors="ignore"))
        names = set(re.findall(r"\bcrate::(\w+)", text))
        for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
            names |= set(re.findall(r"(?:^|,)\s*(\w+)", group))
        for n in sorted(names & set(level)):
            if level[n] > level[m]:
                bad.append(f"{crate}: {f.relative_to(root)}: '{m}' (layer {level[m]}) imports '{n}' (layer {level[n]}), which is above it")
for line in bad:
    print(line)
print(f"{len(bad)} layering problem(s)")
sys.exit(1 if bad else 0)
