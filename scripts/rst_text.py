"""reStructuredText (Sphinx) → plain text, roughly as Sphinx's text builder prints it.

Used by train_default_model.py on the Python documentation's sources. Titles lose their
underlines, paragraphs become one line each, roles and inline markup become their text
(":func:`len`" → "len()", ":ref:`label`" → the labelled section's title), directives become
what they print ("New in version 3.2.", "Note: ...", a function's signature) or nothing (index
entries, toctrees, module metadata), and literal blocks and doctests are kept verbatim.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

SIGNATURES = {
    "function", "method", "classmethod", "staticmethod", "decorator", "attribute", "data", "class",
    "exception", "coroutinefunction", "coroutinemethod", "abstractmethod", "awaitablefunction",
    "describe", "object", "opcode", "cmdoption", "option", "envvar", "pdbcommand",
}  # fmt: skip
ADMONITIONS = {"note": "Note", "warning": "Warning", "seealso": "See also", "important": "Important",
               "caution": "Caution", "impl-detail": "CPython implementation detail", "tip": "Tip"}  # fmt: skip
VERSIONS = {"versionadded": "New in version", "versionchanged": "Changed in version",
            "deprecated": "Deprecated since version", "deprecated-removed": "Deprecated since version"}  # fmt: skip
CODE = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "parsed-literal"}
BODY = {"topic", "sidebar", "rubric", "glossary", "epigraph", "centered", "hlist", "container"}

DIRECTIVE = re.compile(r"(\s*)\.\.\s+([\w:-]+)::\s*(.*)")
UNDERLINE = re.compile(r"\s*([=\-*~^\"#+`'.:_])\1{2,}\s*")
ROLE = re.compile(r":((?:[\w-]+:)*[\w-]+):`([^`]+)`")
LINK = re.compile(r"`([^`<]+?)\s*(?:<[^>]*>)?`__?")
LITERAL = re.compile(r"``(.+?)``")
EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([^*\s][^*\n]*?)\*{1,2}(?![\w*])")


def rst_to_text(source: str, labels: dict[str, str]) -> list[tuple[str, str]]:
    """Sections (title, body) of a reStructuredText document, as plain text; the first title may be ""."""
    lines = source.expandtabs(8).splitlines()
    sections: list[tuple[str, list[tuple[str, str]]]] = [("", [])]
    for kind, line in _blocks(lines):
        if kind == "title":
            sections.append((inline(line, labels), []))
        else:
            sections[-1][1].append((kind, line))
    out = []
    for title, body in sections:
        # Inline markup may span lines of a paragraph, never code: mark up runs of prose together.
        pieces = []
        for kind, run in itertools.groupby(body, key=lambda item: item[0]):
            text = "\n".join(line for _, line in run)
            pieces.append(inline(_reflow(text), labels) if kind == "prose" else text)
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(pieces)).strip("\n")
        if title or text:
            out.append((title, text))
    return out


LIST_ITEM = re.compile(r"\s*(?:[*+-]|#\.|\d+\.|\(?[a-z\d]\)) +")


def _reflow(text: str) -> str:
    """Join each paragraph's wrapped lines into one; list items and indented blocks keep their own lines."""
    out: list[str] = []
    continues_at = -1  # the indent at which a line continues the previous one
    for line in text.split("\n"):
        item = LIST_ITEM.match(line)
        if line.strip() and not item and _indent(line) == continues_at:
            out[-1] += " " + line.strip()
            continue
        out.append(line)
        continues_at = (item.end() if item else _indent(line)) if line.strip() else -1
    return "\n".join(re.sub(r"(?<=\S)  +", " ", line) for line in out)


def rst_labels(source: str) -> dict[str, str]:
    """`.. _label:` targets that stand right before a section title → that title."""
    lines = source.expandtabs(8).splitlines()
    labels = {}
    for i, line in enumerate(lines):
        if m := re.fullmatch(r"\.\. _([^:]+):\s*", line):
            rest = [line for line in lines[i + 1 : i + 8] if line.strip() and not line.startswith(".. _")]
            if UNDERLINE.fullmatch(rest[0]) and len(rest) > 2:
                rest = rest[1:]  # an overline
            if len(rest) > 1 and UNDERLINE.fullmatch(rest[1]):
                labels[m.group(1).lower()] = rest[0].strip()
    return labels


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _body_end(lines: list[str], start: int, indent: int) -> int:
    """First line at or after `start` that is non-blank and indented <= `indent` (the block's end)."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def _blocks(lines: list[str]) -> Iterator[tuple[str, str]]:
    """Yields ("title", text), ("prose", line) (markup still in) and ("code", line) (verbatim)."""
    i = 0
    while i < len(lines):
        line = lines[i]
        if UNDERLINE.fullmatch(line):  # an overline or a stray transition
            i += 1
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and _indent(line) == 0 and UNDERLINE.fullmatch(nxt) and len(nxt.strip()) >= len(line.strip()):
            yield "title", line.strip()
            i += 2
            continue
        m = DIRECTIVE.fullmatch(line)
        if m or line.strip() == ".." or line.lstrip().startswith(".. "):
            indent = _indent(line)
            end = _body_end(lines, i + 1, indent)
            if m:
                yield from _directive(m.group(2), m.group(3), lines[i + 1 : end], indent)
            i = end
            continue
        if line.rstrip().endswith("::"):  # a literal block follows: keep it verbatim
            text = line.rstrip()[:-2].rstrip()
            if text:
                yield "prose", text + (":" if not text.endswith(":") else "")
            # the block is as indented as its first line (in a list item, deeper than the item's text)
            first = next((line for line in lines[i + 1 :] if line.strip()), "")
            end = _body_end(lines, i + 1, max(_indent(first), _indent(line) + 1) - 1)
            for code in lines[i + 1 : end]:
                yield "code", code.rstrip()
            i = end
            continue
        if line.lstrip().startswith(">>>"):
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            for code in lines[i:end]:
                yield "code", code.rstrip()
            i = end
            continue
        if re.fullmatch(r"\s*\+[-=+]+\+\s*|\s*=+( +=+)+\s*", line):  # table borders
            i += 1
            continue
        yield "prose", line.rstrip()
        i += 1


def _directive(name: str, argument: str, body: list[str], indent: int) -> Iterator[tuple[str, str]]:
    """Plain text for one directive with its (still indented) body lines."""
    name = name.removeprefix("py:")
    pad = " " * indent
    # leading field lines (":noindex:", ":synopsis: ...") are options, not text
    while body and re.match(r"\s*:[\w-]+:", body[0]) and not ROLE.match(body[0].strip()):
        body = body[1:]
    if name in SIGNATURES or name.startswith("c:"):
        leading = _leading(body)
        signatures = " \n".join([argument] + [b.strip() for b in leading]).replace("\\ \n", "").splitlines()
        prefix = "class " if name == "class" else "exception " if name == "exception" else ""
        for sig in signatures:
            yield "code", pad + prefix + re.sub(r"\s+", " ", sig.strip())
        yield "code", ""
        yield from _nested(body[len(leading) :])
    elif name in ADMONITIONS:
        nested = list(_nested(body))
        while nested and not nested[0][1].strip():
            nested.pop(0)
        first = argument or (nested.pop(0)[1].strip() if nested and nested[0][0] == "prose" else "")
        yield "prose", pad + ADMONITIONS[name] + ":" + (" " + first if first else "")
        yield from nested
    elif name in VERSIONS:
        version = argument.split()[0] if argument else ""
        rest = argument[len(version) :].strip()
        text = [rest] if rest else []
        nested = [line for _, line in _nested(body)]
        joined = " ".join(t.strip() for t in text + nested if t.strip())
        head = f"{VERSIONS[name]} {version}"
        yield "prose", pad + (f"{head}: {joined}" if joined else head + ".")
    elif name == "availability":
        yield "prose", pad + "Availability: " + argument
    elif name in CODE:
        for code in body:
            yield "code", code.rstrip()
    elif name in BODY:
        if argument:
            yield "prose", pad + argument
            yield "prose", ""
        yield from _nested(body)
    # every other directive (index, toctree, module, audit-event, include, ...) prints nothing


def _leading(body: list[str]) -> list[str]:
    """Continuation lines of a signature: body lines before the first blank one."""
    out = []
    for line in body:
        if not line.strip():
            break
        out.append(line)
    return out if len(out) < len(body) else []


def _nested(body: list[str]) -> Iterator[tuple[str, str]]:
    if not body:
        return
    strip = min(_indent(line) for line in body if line.strip())
    for kind, line in _blocks([line[strip:] for line in body]):
        yield ("prose" if kind == "title" else kind), line


def inline(text: str, labels: dict[str, str]) -> str:
    def role(m: re.Match[str]) -> str:
        name, target = m.groups()
        if "<" in target and target.endswith(">"):
            return target[: target.index("<")].rstrip()
        target = target.lstrip("!")
        if name == "ref":
            return inline(labels[target.lower()], {}) if target.lower() in labels else target.replace("-", " ")
        if name in ("pep", "rfc"):
            return f"{name.upper()} {target}"
        if target.startswith("~"):
            target = target[1:].rsplit(".", 1)[-1]
        if name.endswith(("func", "meth")) and not target.endswith(")"):
            target += "()"
        return target

    text = re.sub(r"\s*\[#?[\w-]*\]_", "", text)  # footnote references
    text = ROLE.sub(role, text)
    text = LITERAL.sub(r"\1", text)
    text = LINK.sub(r"\1", text)
    text = EMPHASIS.sub(r"\1", text)
    return text.replace("\\ ", "")
