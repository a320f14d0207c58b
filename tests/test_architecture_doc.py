"""docs/architecture.md stays true where the code grows: its table of the primitives and the
backends that implement each is rendered from the code (``kernels/primitives.py``'s
declarations, each backend module's functions) and must equal the doc's.

``python tests/test_architecture_doc.py --write`` rewrites the table in the doc."""

import pathlib
import re
import sys

from astrai_kernels.kernels import primitives, registry

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BEGIN, END = "<!-- primitives table: begin -->", "<!-- primitives table: end -->"
KERNEL_BACKENDS = ("triton", "cpp", "torch")
#: each table of declarations, and what the doc calls its primitives
DECLARED = (
    (primitives.PRIMITIVES, "required"),
    ({primitives.SHARD_PRIMITIVE.name: primitives.SHARD_PRIMITIVE},
     "optional: vocabulary parallel"),
    (primitives.SAMPLING_PRIMITIVES, "optional: `sampling=`"),
    (primitives.TOPK_DISTILL_PRIMITIVES, "optional: top-k distillation"),
)


def render_table():
    """The markdown table of every declared primitive and the backends that implement it."""
    modules = {name: registry.backend_module(name) for name in KERNEL_BACKENDS}
    lines = ["| primitive | kind | " + " | ".join(f"`{b}`" for b in KERNEL_BACKENDS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in KERNEL_BACKENDS) + " |"]
    for table, kind in DECLARED:
        for name in table:
            marks = ["yes" if hasattr(modules[b], name) else "-" for b in KERNEL_BACKENDS]
            lines.append(f"| `{name}` | {kind} | " + " | ".join(marks) + " |")
    return "\n".join(lines) + "\n"


def _doc_table(text):
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert match, f"{DOC} has no {BEGIN} ... {END} block"
    return match


def test_the_primitives_table_is_the_codes():
    text = DOC.read_text()
    assert _doc_table(text).group(1) == render_table(), (
        "docs/architecture.md's primitives table is stale: run "
        "`python tests/test_architecture_doc.py --write`")


def test_every_declared_primitive_is_implemented_somewhere():
    """A required primitive on every backend; an optional one on at least one."""
    table = render_table().splitlines()[2:]
    for row in table:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        marks = cells[2:]
        assert "yes" in marks, row
        if cells[1] == "required":
            assert marks == ["yes"] * len(KERNEL_BACKENDS), row


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    text = DOC.read_text()
    span = _doc_table(text).span(1)
    DOC.write_text(text[:span[0]] + render_table() + text[span[1]:])
    print(f"wrote the primitives table of {DOC}")
