"""A report as a list of blocks (headings, paragraphs, tables, code, images), rendered to
Markdown or to one self-contained HTML page. Reports are built once and rendered twice."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field


@dataclass
class Table:
    headers: list
    rows: list
    align: str = ""           # one char per column: l or r (default: l for the first, r for the rest)


@dataclass
class Doc:
    title: str
    blocks: list = field(default_factory=list)

    def h(self, text, level=2):
        self.blocks.append(("h", level, text))

    def p(self, text):
        self.blocks.append(("p", text))

    def items(self, items):
        self.blocks.append(("list", list(items)))

    def table(self, headers, rows, align=""):
        self.blocks.append(("table", Table(headers, [list(r) for r in rows], align)))

    def code(self, text, lang=""):
        self.blocks.append(("code", lang, text))

    def image(self, path, alt):
        self.blocks.append(("img", path, alt))


# --- number formatting shared by every page ------------------------------------------------

def ms(x, unit=True) -> str:
    """Milliseconds with precision that follows the size: 306.5, 63.21, 0.412."""
    if x is None:
        return "—"
    a = abs(x)
    s = f"{x:.1f}" if a >= 100 else f"{x:.2f}" if a >= 1 else f"{x:.3f}"
    return s + ("ms" if unit else "")


def pct(x) -> str:
    return "—" if x is None else f"{x:.1f}%"


def ratio(x) -> str:
    return "—" if x is None else f"{x:.1f}x"


def num(x, digits=1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


# --- Markdown ---------------------------------------------------------------------------------

def _md_cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _aligns(t: Table) -> str:
    return t.align or ("l" + "r" * (len(t.headers) - 1))


def render_md(doc: Doc) -> str:
    out = [f"# {doc.title}", ""]
    for b in doc.blocks:
        kind = b[0]
        if kind == "h":
            out += ["#" * b[1] + " " + b[2], ""]
        elif kind == "p":
            out += [b[1], ""]
        elif kind == "list":
            out += [f"- {x}" for x in b[1]] + [""]
        elif kind == "code":
            out += [f"```{b[1]}", b[2].rstrip("\n"), "```", ""]
        elif kind == "img":
            out += [f"![{b[2]}]({b[1]})", ""]
        elif kind == "table":
            t = b[1]
            al = _aligns(t)
            out.append("| " + " | ".join(_md_cell(h) for h in t.headers) + " |")
            out.append("|" + "|".join("---:" if a == "r" else ":---" for a in al) + "|")
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in t.rows]
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


# --- HTML ---------------------------------------------------------------------------------------

_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em}th,td{border:1px solid #ccc;padding:3px 8px}
th{background:#f3f3f3}td.r,th.r{text-align:right;font-variant-numeric:tabular-nums}
code,pre{background:#f6f6f6;font-family:ui-monospace,monospace}pre{padding:.6em;overflow-x:auto}
img{max-width:100%;border:1px solid #ddd}h1{font-size:1.6em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}"""


def _inline(text: str) -> str:
    s = html.escape(str(text))
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    s = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)
    s = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r'<a href="\2">\1</a>', s)
    return s


def render_html(doc: Doc) -> str:
    out = ["<!doctype html>", '<html><head><meta charset="utf-8">', f"<title>{html.escape(doc.title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(doc.title)}</h1>"]
    for b in doc.blocks:
        kind = b[0]
        if kind == "h":
            out.append(f"<h{b[1]}>{_inline(b[2])}</h{b[1]}>")
        elif kind == "p":
            out.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "code":
            out.append(f"<pre><code>{html.escape(b[2])}</code></pre>")
        elif kind == "img":
            out.append(f'<p><img src="{html.escape(b[1])}" alt="{html.escape(b[2])}"></p>')
        elif kind == "table":
            t = b[1]
            al = _aligns(t)
            head = "".join(f'<th class="{a}">{_inline(h)}</th>' for h, a in zip(t.headers, al))
            body = "".join("<tr>" + "".join(f'<td class="{a}">{_inline(c)}</td>' for c, a in zip(row, al))
                           + "</tr>" for row in t.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
