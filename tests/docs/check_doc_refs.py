#!/usr/bin/env python3
"""Check that the repository's references to its own documentation resolve.

Usage: check_doc_refs.py REPO_ROOT

Files: those `git ls-files` lists (tracked, plus untracked files git does not ignore, so a
new page is checked before its first commit); without git, a walk of REPO_ROOT that skips
build*/ and .git. Binary files are skipped. In each file:

  * `docs/<name>.md` and `bench/<name>.md`, anywhere (code comments, docstrings, markdown):
    paths from the repository root; the file must exist;
  * section citations right after such a reference, as in `docs/<name>.md §4` or
    `(docs/<name>.md §1, §5.2)`: the document must have a heading with that number
    ("## 4. ..." or "### 5.2 ...");
  * `README.md#<anchor>`: README.md must have a heading with that anchor;
  * `../shared` paths: they point outside the repository, which is always an error;
  * in .md files, outside code: relative links and images `[text](path)`,
    `[text](path#anchor)`, `[text](#anchor)` and `[label]: path` definitions. The path
    (relative to the file; a leading / means the repository root) must exist inside the
    repository, and an anchor into a .md file must name one of its headings (GitHub's
    rule: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for repeats).

Prints "FILE:LINE: message" for each broken reference and exits 1; exits 0 with a summary
line when all resolve; exits 2 on bad usage. Standard library only.
"""

import os
import re
import subprocess
import sys
import urllib.parse

DOC_REF = re.compile(r"(?<![\w./-])((?:docs|bench)/[\w-]+(?:/[\w-]+)*\.md)\b")
README_ANCHOR = re.compile(r"(?<![\w./-])README\.md#([\w-]+)")
SHARED_REF = re.compile(r"(?<![\w.])\.\.(/shared/[\w./-]*)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
LEADING_SECTIONS = re.compile(r"^\s*§\d+(?:\.\d+)*(?:(?:\s*,\s*|\s+and\s+|\s*&\s*)§\d+(?:\.\d+)*)*")
MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
MD_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SECTION_NUMBER = re.compile(r"^(\d+(?:\.\d+)*)\.?(?:\s|$)")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
COMMENT_LEAD = re.compile(r"^\s*(?://+|#+|\*+|/\*+|--)?\s*")


def list_files(root):
    """Repository-relative paths of the files to check, and whether git listed them."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True).stdout
        files = sorted({f for f in out.decode("utf-8", "replace").split("\0") if f})
        if files:
            return files, True
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not d.startswith("build"))
        for name in sorted(filenames):
            files.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return files, False


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", "replace")


def slugify(text):
    """GitHub's heading anchor (without the -N suffix of repeated headings)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


class Checker:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.files, self.from_git = list_files(self.root)
        self.file_set = set(self.files)
        self.dir_set = set()
        for f in self.files:
            parts = f.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                self.dir_set.add("/".join(parts[:i]))
        self.headings_cache = {}
        self.errors = []
        self.checked = 0

    # ---- targets

    def exists(self, rel):
        """`rel`: a normalised repository-relative path ('' = the root)."""
        if rel in ("", "."):
            return True
        if self.from_git:
            return rel in self.file_set or rel in self.dir_set
        return os.path.exists(os.path.join(self.root, rel))

    def headings(self, rel):
        """(anchors, section numbers) of the markdown file `rel`."""
        if rel not in self.headings_cache:
            anchors, sections, seen = set(), set(), {}
            text = read_text(os.path.join(self.root, rel)) or ""
            in_fence = False
            for line in text.splitlines():
                if FENCE.match(line):
                    in_fence = not in_fence
                    continue
                m = None if in_fence else HEADING.match(line)
                if not m:
                    continue
                title = m.group(2)
                base = slugify(title)
                n = seen.get(base, 0)
                seen[base] = n + 1
                anchors.add(base if n == 0 else f"{base}-{n}")
                num = SECTION_NUMBER.match(title)
                if num:
                    sections.add(num.group(1))
            self.headings_cache[rel] = (anchors, sections)
        return self.headings_cache[rel]

    def error(self, where, msg):
        self.errors.append(f"{where}: {msg}")

    # ---- references in any file

    def cited_sections(self, line, start, end, next_line):
        """Section numbers cited right after the reference line[start:end]."""
        before = line[:start]
        tail = line[end:]
        if before.count("(") > before.count(")"):
            # Inside parentheses: every § up to the closing one, which may be on the next line.
            text, depth, out = tail + " " + COMMENT_LEAD.sub("", next_line, count=1), 0, []
            for ch in text:
                if ch == "(":
                    depth += 1
                elif ch == ")":
                    if depth == 0:
                        break
                    depth -= 1
                out.append(ch)
            return SECTION.findall("".join(out))
        if not tail.strip():
            tail = COMMENT_LEAD.sub("", next_line, count=1)
        m = LEADING_SECTIONS.match(tail)
        return SECTION.findall(m.group(0)) if m else []

    def check_plain(self, rel, lines):
        for i, line in enumerate(lines):
            where = f"{rel}:{i + 1}"
            next_line = lines[i + 1] if i + 1 < len(lines) else ""
            for m in DOC_REF.finditer(line):
                target = m.group(1)
                self.checked += 1
                if not self.exists(target):
                    self.error(where, f"missing target '{target}'")
                    continue
                _, sections = self.headings(target)
                for sec in self.cited_sections(line, m.start(), m.end(), next_line):
                    if sec not in sections:
                        self.error(where, f"'{target}' has no section §{sec}")
            for m in README_ANCHOR.finditer(line):
                self.checked += 1
                if not self.exists("README.md"):
                    self.error(where, "missing target 'README.md'")
                elif m.group(1).lower() not in self.headings("README.md")[0]:
                    self.error(where, f"missing target 'README.md#{m.group(1)}' (no such heading)")
            for m in SHARED_REF.finditer(line):
                self.checked += 1
                self.error(where, f"'..{m.group(1).rstrip('.')}' points outside the repository")

    # ---- links in markdown files

    def check_link(self, rel, where, target):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            return  # URL, mailto:, empty
        self.checked += 1
        path, _, anchor = target.partition("#")
        path = urllib.parse.unquote(path)
        if path:
            base = "" if path.startswith("/") else os.path.dirname(rel)
            joined = os.path.normpath(os.path.join(self.root, base, path.lstrip("/")))
            if os.path.commonpath([self.root, joined]) != self.root:
                self.error(where, f"link '{target}' points outside the repository")
                return
            resolved = os.path.relpath(joined, self.root).replace(os.sep, "/")
            if not self.exists(resolved):
                self.error(where, f"missing target '{target}' (resolved to '{resolved}')")
                return
        else:
            resolved = rel
        if anchor and resolved.endswith(".md") and os.path.isfile(os.path.join(self.root, resolved)):
            if urllib.parse.unquote(anchor).lower() not in self.headings(resolved)[0]:
                self.error(where, f"missing target '{target}' (no heading '#{anchor}' in {resolved})")

    def check_markdown(self, rel, lines):
        in_fence = False
        for i, line in enumerate(lines):
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            if in_fence:
                continue
            where = f"{rel}:{i + 1}"
            text = re.sub(r"(`+).*?\1", lambda m: " " * len(m.group(0)), line)  # inline code
            for m in MD_LINK.finditer(text):
                self.check_link(rel, where, m.group(1))
            m = MD_DEFINITION.match(text)
            if m:
                self.check_link(rel, where, m.group(1))

    def run(self):
        for rel in self.files:
            text = read_text(os.path.join(self.root, rel))
            if text is None:
                continue
            lines = text.splitlines()
            self.check_plain(rel, lines)
            if rel.endswith(".md"):
                self.check_markdown(rel, lines)
        return self.errors


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    checker = Checker(argv[1])
    errors = checker.run()
    for e in errors:
        print(e)
    if errors:
        print(f"check_doc_refs: FAIL ({len(errors)} broken of {checker.checked} references)")
        return 1
    print(f"check_doc_refs: OK ({checker.checked} references in {len(checker.files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
