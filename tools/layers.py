#!/usr/bin/env python3
"""Checks that evalfleet's crates, and the modules inside the crates that
hold several, import only from their own layer or the layers below it, as
docs/architecture.md draws them.

Crates: every crate of the workspace is in one layer of CRATES; a crate's
[dependencies] (not its dev-dependencies, which tests may take from above)
may name only crates of its own layer or below. Cargo refuses circles
between crates; this refuses an import that points up.

Modules: a module is a file or folder directly under a crate's src/; it
imports N when one of its files (outside #[cfg(test)]) names `crate::N`,
or `super::N` from a top-level file. For the crates in MODULES, a module
missing from the table, or an import that points up, fails the check.
Circles within a layer are ../shared/tools/module_cycles.py's business.

    python3 tools/layers.py [ROOT]

Exits 1 with each problem and its file.
"""
import pathlib
import re
import sys

CRATES = [
    # Plain types, the template language, the stand-in engine, test helpers.
    ["evalfleet-types", "evalfleet-jinja", "evalfleet-mock", "evalfleet-testkit"],
    # What an answer is worth; the walls programs and agents run behind.
    ["evalfleet-eval", "evalfleet-sandbox"],
    # The config, validated in one pure step.
    ["evalfleet-config"],
    # Datasets, images, templates, fingerprints.
    ["evalfleet-io"],
    # What a run stores, and where.
    ["evalfleet-store"],
    # The client and the endpoints: limits, rates, health, engines.
    ["evalfleet-fleet"],
    # Agents' calls over the fleet's one call path.
    ["evalfleet-gateway"],
    # Tasks, and the pipeline that drives them.
    ["evalfleet-pipeline"],
    # Google Sheets in and out; typed reports.
    ["evalfleet-sheets", "evalfleet-reports"],
    # Orchestration: runs, workers, benchmark matrices.
    ["evalfleet-core"],
    # The HTTP API and dashboard.
    ["evalfleet-server"],
    # The command line.
    ["evalfleet"],
]

MODULES = {
    "evalfleet-io": [
        # Where a run's files may be opened from.
        ["confine"],
        ["dataset", "images"],
        ["template", "fingerprint"],
    ],
    "evalfleet-pipeline": [
        # One module per kind of task.
        ["task"],
        # What an item is to the pipeline; what the writer is handed; until
        # when the session's claims hold.
        ["item", "outcome", "lease"],
        # Drives items through their task's steps.
        ["reader", "writer", "dispatch"],
    ],
    "evalfleet-core": [
        # What the front end lends; every template rendered before a run.
        ["frontend", "preflight"],
        # Creating, resuming and finishing runs; scoring stored answers
        # again.
        ["run", "rescore"],
        # Why a session failed; a sheet's part in one; a conversation's logs.
        ["error"],
        ["sheet", "conversation"],
        # A session from its config to its end.
        ["session"],
        # A benchmark matrix's plan and report; the matrix run above
        # sessions.
        ["bench"],
        ["matrix"],
    ],
    "evalfleet": [
        ["cli", "ui", "fleet"],
        # A session as the terminal or a server attends it.
        ["attend"],
        ["commands"],
    ],
    "evalfleet-server": [
        # What a request gets when it fails; what the server may ask of
        # runs; digests of keys; the names the server answers to.
        ["error", "control", "extract", "keys", "hosts"],
        # The gateway's routes, which carry their own credentials (items'
        # tokens).
        ["gateway"],
        # Sign-in sessions and wrong keys counted.
        ["sessions"],
        # Shared state, and who may ask.
        ["state", "auth"],
        # The JSON API, and the dashboard's pages.
        ["api", "pages", "metrics", "env"],
    ],
}


def dependencies(manifest):
    """The workspace crates a Cargo.toml's [dependencies] names."""
    names, section = [], None
    for line in manifest.read_text().splitlines():
        header = re.match(r"\s*\[([^\]]+)\]", line)
        if header:
            section = header.group(1).strip()
            continue
        name = re.match(r"\s*(evalfleet[\w-]*)\s*[.=]", line)
        if section == "dependencies" and name:
            names.append(name.group(1))
    return names


root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
bad = []

level = {c: i for i, layer in enumerate(CRATES) for c in layer}
for manifest in sorted(root.glob("crates/*/Cargo.toml")):
    crate = manifest.parent.name
    if crate not in level:
        bad.append(f"crate '{crate}' is in no layer (add it to tools/layers.py)")
        continue
    for dep in dependencies(manifest):
        if dep in level and level[dep] > level[crate]:
            bad.append(
                f"{manifest.relative_to(root)}: '{crate}' (layer {level[crate]}) depends on "
                f"'{dep}' (layer {level[dep]}), which is above it"
            )

for crate, layers in MODULES.items():
    src = root / "crates" / crate / "src"
    mlevel = {m: i for i, layer in enumerate(layers) for m in layer}
    mods = {p.stem if p.is_file() else p.name for p in src.iterdir() if p.suffix == ".rs" or p.is_dir()}
    mods -= {"lib", "main"}
    for m in sorted(mods - set(mlevel)):
        bad.append(f"{crate}: module '{m}' is in no layer (add it to tools/layers.py)")
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).parts
        m = rel[0][:-3] if len(rel) == 1 else rel[0]
        if m not in mlevel:
            continue
        text = re.sub(r"#\[cfg\(test\)\][\s\S]*", "", f.read_text(errors="ignore"))
        prefixes = r"(?:crate|super)" if len(rel) == 1 else r"crate"
        names = set(re.findall(rf"\b{prefixes}::(\w+)", text))
        for group in re.findall(rf"\b{prefixes}::\{{([^}}]*)\}}", text):
            names |= set(re.findall(r"(?:^|,)\s*(\w+)", group))
        for n in sorted(names & set(mlevel)):
            if mlevel[n] > mlevel[m]:
                bad.append(
                    f"{crate}: {f.relative_to(root)}: '{m}' (layer {mlevel[m]}) imports '{n}' "
                    f"(layer {mlevel[n]}), which is above it"
                )

for line in bad:
    print(line)
print(f"{len(bad)} layering problem(s)")
sys.exit(1 if bad else 0)
