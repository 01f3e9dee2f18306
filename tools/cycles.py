#!/usr/bin/env python3
"""Circles of imports between sibling modules, in every folder of every crate.

../shared/tools/module_cycles.py looks at a crate's top-level modules; this
looks inside folders too (config's sections, the pipeline's dispatch and
writer, a task folder's kinds). Module A imports its sibling B when one of
A's files, outside #[cfg(test)] and comments, names B by `crate::...::B`,
`super::B` or `self::B`. Prints each circle with its edges; exits 1 if any.

    python3 tools/cycles.py [ROOT]
"""
import re, sys, pathlib, collections
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
total = 0
def modpath(src, f):
    rel = list(f.relative_to(src).parts)
    rel[-1] = rel[-1][:-3]
    if rel[-1] in ("lib", "main", "mod"): rel = rel[:-1]
    return rel
for src in sorted(root.glob("crates/*/src")):
    files = list(src.rglob("*.rs"))
    mods = set()
    for f in files:
        p = modpath(src, f)
        for i in range(len(p) + 1): mods.add(tuple(p[:i]))
    edges = collections.defaultdict(lambda: collections.defaultdict(set))
    for f in files:
        me = modpath(src, f)
        if me and me[-1] == "tests": continue
        text = re.sub(r"#\[cfg\(test\)\][\s\S]*", "", f.read_text(errors="ignore"))
        text = re.sub(r"//[^\n]*", "", text)
        refs = []
        for m in re.finditer(r"\b(crate|super|self)((?:::\w+)+)(::\{([^}]*)\})?", text):
            base = {"crate": [], "self": list(me), "super": list(me[:-1])}[m.group(1)]
            segs = [s for s in m.group(2).split("::") if s]
            # super::super
            while segs and segs[0] == "super":
                base = base[:-1]; segs = segs[1:]
            refs.append(base + segs)
            if m.group(4):
                for n in re.findall(r"(?:^|,)\s*(\w+)", m.group(4)):
                    refs.append(base + segs + [n])
        for m in re.finditer(r"\b(crate|super)::\{([^}]*)\}", text):
            base = [] if m.group(1) == "crate" else list(me[:-1])
            for n in re.findall(r"(?:^|,)\s*(\w+)", m.group(2)):
                refs.append(base + [n])
        for t in refs:
            i = 0
            while i < len(me) and i < len(t) and me[i] == t[i]: i += 1
            if i >= len(me) or i >= len(t): continue
            a, b = me[i], t[i]
            folder = tuple(me[:i])
            if folder + (b,) in mods and a != b and b != "tests":
                edges[folder][a].add(b)
    for folder, es in edges.items():
        index, low, stack, on, comps, c = {}, {}, [], set(), [], [0]
        nodes = set(es) | {x for v in es.values() for x in v}
        def visit(v):
            index[v] = low[v] = c[0]; c[0] += 1; stack.append(v); on.add(v)
            for w in es.get(v, ()):
                if w not in index: visit(w); low[v] = min(low[v], low[w])
                elif w in on: low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v: break
                if len(comp) > 1: comps.append(sorted(comp))
        for v in sorted(nodes):
            if v not in index: visit(v)
        for comp in comps:
            total += 1
            where = "/".join(folder) or "src"
            print(f"{src.parent.name}: {where}: circle of {len(comp)}: {', '.join(comp)}")
            for a in comp:
                print(f"    {a} -> {', '.join(sorted(b for b in es.get(a, ()) if b in comp))}")
print(f"{total} circle(s) of imports between sibling modules")
sys.exit(1 if total else 0)
