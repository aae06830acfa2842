#!/usr/bin/env python3
"""Print the module-level `use` cycles of one Rust crate.

usage: modcycles.py SRC_DIR [--edges] [--strict]
       modcycles.py --self-test

The modules are the files reachable from the crate root (SRC_DIR/lib.rs,
and SRC_DIR/main.rs as a second crate when both exist) through `mod NAME;`
declarations; a module declared under `#[cfg(test)]` is left out with
everything under it (tests may use anything), and so are `#[cfg(test)]`
items inside a module. Inline `mod NAME { ... }` blocks count as part of
their file.

An edge M -> N means code in M names a path inside N: `crate::n::...`,
`super::...`, `self::...`, a path starting with a child module M declares,
or one starting with a module M imported by name (`use crate::cm;` and then
`cm::conn::f()` is an edge to `cm::conn`). `use` trees are expanded
(`use crate::{a, b::{c, d}}`). A path is charged to the deepest module it
reaches; a name a module re-exports (`pub use c::Foo`) is followed to where
it is defined.

A module naming its own ancestor or descendant is not counted (a child
using the items its parent defines, and the parent using the child, is
Rust's ordinary shape); `--strict` counts those edges too. Cycles are the
strongly connected components with more than one module. Exit status 1
when there is a cycle, 2 on a usage error.

--self-test builds small crates in a temporary directory, one per form of
path above, and checks what is found (exit 1 on a miss).
"""
import os
import re
import sys
import tempfile

IDENT = r"(?:r#)?[A-Za-z_][A-Za-z0-9_]*"  # `r#async` is module `async`


def strip_code(text):
    """The code of a Rust file with comments removed and every string or
    char literal emptied, so that `crate::`, braces and `;` in them are not
    read as code. Block comments nest, as in Rust."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c == "/" and nxt == "*":
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            out.append(" ")
        elif c in "rb" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            # raw strings r"..", r#".."#, br".." and byte strings b".."
            m = re.match(r'(?:br|r)(#*)"', text[i:]) or re.match(r'b()"', text[i:])
            if m and (m.group(0).startswith("r") or m.group(0).startswith("br")):
                close = '"' + m.group(1)
                j = text.find(close, i + len(m.group(0)))
                i = n if j < 0 else j + len(close)
                out.append('""')
            elif m:
                i = skip_string(text, i + 1)
                out.append('""')
            else:
                out.append(c)
                i += 1
        elif c == '"':
            i = skip_string(text, i)
            out.append('""')
        elif c == "'":
            # a char literal ('x', '\n', '\u{7f}', '"') or a lifetime ('a)
            m = re.match(r"'(?:\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def skip_string(text, i):
    """Index just past the string literal whose opening quote is at i."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return i


CFG_TEST = re.compile(r"#\[cfg\((?:test|all\(\s*test\b[^\]]*)\)\]")


def strip_cfg_test(text):
    """Drop every item under `#[cfg(test)]` (or `cfg(all(test, ..))`)."""
    out = []
    i = 0
    while True:
        m = CFG_TEST.search(text, i)
        if not m:
            out.append(text[i:])
            break
        out.append(text[i : m.start()])
        j = m.end()
        # skip to the item's end: a `;` before any `{`, or the matching `}`;
        # further attributes (`#[allow(..)]`) hold neither
        depth = 0
        while j < len(text):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    j += 1
                    break
            elif c == ";" and depth == 0:
                j += 1
                break
            j += 1
        i = j
    return "".join(out)


def use_trees(text):
    """Every `use` declaration's tree, with whether it is a `pub` one."""
    for m in re.finditer(r"(\bpub(?:\s*\([^)]*\))?\s+)?\buse\s+([^;]+);", text):
        yield bool(m.group(1)), " ".join(m.group(2).split())


def expand(tree):
    """The paths of one use tree, groups expanded: `a::{b, c::{d}}` gives
    `a::b`, `a::c::d`; `a::{self}` gives `a`. An `as` alias stays."""
    tree = tree.strip()
    if "{" not in tree:
        yield tree
        return
    prefix, rest = tree.split("{", 1)
    body = rest[: rest.rfind("}")]
    depth, cur, items = 0, "", []
    for c in body:
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if c == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += c
    items.append(cur)
    for item in items:
        item = item.strip()
        if not item:
            continue
        if item == "self" or item.startswith("self "):
            yield prefix.rstrip(": ") + item[4:]
        else:
            yield from expand(prefix + item)


def unraw(ident):
    return ident[2:] if ident.startswith("r#") else ident


def split_alias(path):
    m = re.search(r"\s+as\s+(" + IDENT + r")$", path)
    if m:
        return path[: m.start()].strip(), m.group(1)
    return path.strip(), None


class Crate:
    def __init__(self, root_file):
        self.files = {}  # module tuple -> file path
        self.texts = {}  # module tuple -> code without comments, literals, tests
        self.children = {}  # module tuple -> names of its file modules
        self._load((), root_file, True)
        self.modules = set(self.files)

    def _load(self, mod, path, is_dir_module):
        self.files[mod] = path
        with open(path, encoding="utf-8") as f:
            text = strip_cfg_test(strip_code(f.read()))
        self.texts[mod] = text
        base = os.path.dirname(path)
        if not is_dir_module:
            base = os.path.join(base, os.path.basename(path)[:-3])
        kids = set()
        pat = r"(?:^|(?<=[;}\]]))\s*(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;"
        for m in re.finditer(pat, text, re.M):
            name = unraw(m.group(1))
            flat = os.path.join(base, name + ".rs")
            nested = os.path.join(base, name, "mod.rs")
            if os.path.exists(flat):
                kids.add(name)
                self._load(mod + (name,), flat, False)
            elif os.path.exists(nested):
                kids.add(name)
                self._load(mod + (name,), nested, True)
        self.children[mod] = kids

    def absolute(self, mod, path, names):
        """A path as written in `mod` as an absolute tuple, or None when it
        starts outside the crate. `names` maps a module's local names
        (children, imported modules) to absolute tuples."""
        segs = [unraw(s) for s in re.split(r"\s*::\s*", path.strip()) if s]
        if not segs:
            return None
        if segs[0] == "crate":
            return tuple(segs[1:])
        if segs[0] == "self":
            return mod + tuple(segs[1:])
        if segs[0] == "super":
            base = mod
            while segs and segs[0] == "super":
                base = base[:-1]
                segs = segs[1:]
            return base + tuple(segs)
        if segs[0] in names:
            return names[segs[0]] + tuple(segs[1:])
        return None

    def edges(self, strict=False):
        child_names = {m: {c: m + (c,) for c in self.children[m]} for m in self.modules}
        # re-exports: (module, name) -> absolute path
        reexports = {}
        for mod, text in self.texts.items():
            for public, tree in use_trees(text):
                if not public:
                    continue
                for p in expand(tree):
                    p, alias = split_alias(p)
                    a = self.absolute(mod, p, child_names[mod])
                    if a and a[-1] != "*":
                        reexports[(mod, alias or a[-1])] = a

        def resolve(a, seen=0):
            """Deepest module an absolute path reaches, following re-exports."""
            for i in range(len(a), -1, -1):
                if a[:i] in self.modules:
                    rest = a[i:]
                    if rest and (a[:i], rest[0]) in reexports and seen < 8:
                        return resolve(reexports[(a[:i], rest[0])] + rest[1:], seen + 1)
                    return a[:i]
            return ()

        edges = {m: set() for m in self.modules}
        for mod, text in self.texts.items():
            names = dict(child_names[mod])
            paths = []
            for _, tree in use_trees(text):
                for p in expand(tree):
                    p, alias = split_alias(p)
                    p = re.sub(r"\s*::\s*\*$", "", p)
                    paths.append(p)
                    # `use crate::cm;` makes `cm::conn::f()` a path into cm::conn
                    a = self.absolute(mod, p, child_names[mod])
                    if a is not None and a in self.modules:
                        names[unraw(alias) if alias else a[-1]] = a
            code = re.sub(r"\buse\s+[^;]+;", ";", text)
            sep = r"(?:\s*::\s*" + IDENT + r")+"
            paths += re.findall(r"(?<![\w$])((?:crate|super|self)" + sep + ")", code)
            paths += re.findall(r"\$crate(" + sep + ")", code)
            paths = [("crate" + p if p.startswith(":") else p) for p in paths]
            for name in names:
                paths += re.findall(r"(?<![\w:$])(" + re.escape(name) + sep + ")", code)
            for p in paths:
                a = self.absolute(mod, p, names)
                if a is None:
                    continue
                target = resolve(a)
                if target == mod or target not in self.modules:
                    continue
                related = target[: len(mod)] == mod or mod[: len(target)] == target
                if strict or not related:
                    edges[mod].add(target)
        return edges


def cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, sccs = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sccs


def name(m):
    return "crate" if not m else "::".join(m)


def report(label, crate, show_edges, strict):
    edges = crate.edges(strict)
    if show_edges:
        for m in sorted(edges):
            for n in sorted(edges[m]):
                print(f"{label}: {name(m)} -> {name(n)}")
    sccs = cycles(edges)
    if not sccs:
        print(f"{label}: no cycles ({len(crate.modules)} modules)")
        return 0
    for comp in sccs:
        print(f"{label}: cycle among {len(comp)} modules: " + ", ".join(name(m) for m in comp))
        comp_set = set(comp)
        for m in comp:
            inner = sorted(name(n) for n in edges[m] if n in comp_set)
            print(f"    {name(m)} -> {', '.join(inner)}")
    return 1


def roots(src):
    found = [(f, os.path.join(src, f)) for f in ("lib.rs", "main.rs")]
    found = [(f, p) for f, p in found if os.path.exists(p)]
    if len(found) == 1:
        return [(src, found[0][1])]
    return [(f"{src} ({f[:-3]})", p) for f, p in found]


# (files of a crate, edges that must be found, edges that must not be)
SELF_TESTS = {
    "grouped use": (
        {"lib.rs": "mod a; mod b; mod c;", "a.rs": "use crate::{b, c::{X, Y}};",
         "b.rs": "", "c.rs": "pub struct X; pub struct Y;"},
        {("a", "b"), ("a", "c")}, set()),
    "super and self": (
        {"lib.rs": "mod p;", "p/mod.rs": "mod x; mod y; mod z;",
         "p/x.rs": "use super::y::Y;", "p/y.rs": "pub struct Y; fn f() { self::g(); super::z::h() } fn g() {}",
         "p/z.rs": "pub fn h() {}"},
        {("p::x", "p::y"), ("p::y", "p::z")}, set()),
    "paths in code": (
        {"lib.rs": "mod a; mod b;", "a.rs": "fn f() { crate::b::g(); }", "b.rs": "pub fn g() {}"},
        {("a", "b")}, set()),
    "imported module then its child": (
        {"lib.rs": "mod cm; mod other;", "cm/mod.rs": "mod conn; mod event;",
         "cm/conn.rs": "pub fn f() {}", "cm/event.rs": "use crate::cm; fn g() { cm::conn::f() }",
         "other.rs": "use crate::cm::event as ev; fn h() { ev::x() }"},
        {("cm::event", "cm::conn"), ("other", "cm::event")}, set()),
    "re-export followed": (
        {"lib.rs": "mod a; mod b; pub use b::Thing;", "a.rs": "use crate::Thing;",
         "b.rs": "pub struct Thing;"},
        {("a", "b")}, set()),
    "literals and comments are not code": (
        {"lib.rs": "mod a; mod b; mod c;",
         "a.rs": 'const U: &str = "http://x"; use crate::b::B; const Q: char = \'"\'; use crate::c::C;\n'
                 "/* outer /* inner */ crate::c::D */ // crate::c::E\n"
                 'const R: &str = r#"crate::c::F "quoted" "#;',
         "b.rs": "pub struct B;", "c.rs": "pub struct C; use crate::a;"},
        {("a", "b"), ("a", "c"), ("c", "a")}, set()),
    "cfg(test) left out": (
        {"lib.rs": "mod a; mod b;", "a.rs": "#[cfg(test)]\nmod tests;\n#[cfg(test)]\nmod inline { use crate::b::B; }",
         "a/tests.rs": "use crate::b::B;", "b.rs": "pub struct B; use crate::a;"},
        {("b", "a")}, {("a", "b"), ("a::tests", "b")}),
    "lib and main are two crates": (
        {"lib.rs": "pub mod a; pub mod b;", "a.rs": "use crate::b;", "b.rs": "",
         "main.rs": "mod c; mod d; fn main() { stag::a::f() }", "c.rs": "use crate::d;", "d.rs": ""},
        {("a", "b"), ("c", "d")}, set()),
}


def self_test():
    failed = 0
    for title, (files, want, unwanted) in SELF_TESTS.items():
        with tempfile.TemporaryDirectory() as d:
            for rel, text in files.items():
                path = os.path.join(d, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            got = set()
            for _, root in roots(d):
                got |= {(name(m), name(n)) for m, ns in Crate(root).edges().items() for n in ns}
            want_named = {(a, b) for a, b in want}
            missing = want_named - got
            extra = got & unwanted
            if missing or extra:
                failed += 1
                print(f"modcycles self-test: {title}: FAILED (missing {sorted(missing)}, unwanted {sorted(extra)})")
    print(f"modcycles self-test: {len(SELF_TESTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main():
    args = sys.argv[1:]
    if args == ["--self-test"]:
        return self_test()
    dirs = [a for a in args if not a.startswith("--")]
    if len(dirs) != 1 or not roots(dirs[0].rstrip("/")):
        print(__doc__)
        return 2
    src = dirs[0].rstrip("/")
    rc = 0
    for label, root in roots(src):
        rc |= report(label, Crate(root), "--edges" in args, "--strict" in args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
