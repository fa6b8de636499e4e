"""Draws paged_kv.svg, the picture of a paged KV cache in README.md and docs/index.md.

    python docs/img/paged_kv.py

Two sequences share the KV of their common first block; each block table maps a sequence's
logical blocks to physical blocks scattered over the cache; the last blocks fill as tokens come.
"""

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

BLOCK = 4  # tokens per block, small enough to draw
SEQS = {  # name: (words, block table, colour)
    "A": ("the cat sat on the mat and then it slept".split(), [7, 1, 3], "#4c78a8"),
    "B": ("the cat sat on a hat".split(), [7, 4], "#f58518"),
}
SHARED = "#8e6bbf"
NUM_BLOCKS = 8
CELL_W, CELL_H = 1.15, 0.5
plt.rcParams["svg.fonttype"] = "none"  # text stays text


def cells(ax, x, y, texts, colours, fontsize=8):
    for i, (text, colour) in enumerate(zip(texts, colours)):
        ax.add_patch(Rectangle((x + i * CELL_W, y), CELL_W, CELL_H, facecolor=colour, edgecolor="white", lw=1.5))
        ax.text(x + (i + 0.5) * CELL_W, y + CELL_H / 2, text, ha="center", va="center", fontsize=fontsize,
                color="white" if colour != "#e8e8e8" else "#999999")


def main() -> None:
    fig, ax = plt.subplots(figsize=(9.0, 4.4))
    ax.set_xlim(0, 23.5)
    ax.set_ylim(-1.0, 8.6)
    ax.axis("off")
    owner = {}
    for name, (_, table, colour) in SEQS.items():
        for logical, physical in enumerate(table):
            owner[physical] = SHARED if physical in owner else colour
    physical_words = {}
    for name, (words, table, _) in SEQS.items():
        for logical, physical in enumerate(table):
            physical_words[physical] = words[logical * BLOCK:(logical + 1) * BLOCK]

    ax.text(0.2, 8.2, "Logical blocks of each sequence", fontsize=10, weight="bold")
    ax.text(10.3, 8.2, "Block tables", fontsize=10, weight="bold")
    ax.text(15.2, 8.2, "Physical KV blocks (one cache for all)", fontsize=10, weight="bold")
    rows = {"A": 6.4, "B": 3.0}
    table_slots = {}
    for name, (words, table, colour) in SEQS.items():
        y = rows[name]
        ax.text(0.2, y + 1.25, f"sequence {name}", fontsize=9, color=colour, weight="bold")
        for logical, physical in enumerate(table):
            chunk = words[logical * BLOCK:(logical + 1) * BLOCK]
            yy = y + 0.55 - logical * 0.7
            cells(ax, 0.2, yy, chunk + [""] * (BLOCK - len(chunk)),
                  [owner[physical]] * len(chunk) + ["#e8e8e8"] * (BLOCK - len(chunk)))
            ax.text(0.2 + BLOCK * CELL_W + 0.15, yy + CELL_H / 2, f"block {logical}", fontsize=8, va="center",
                    color="#555555")
            # the block table entry
            tx = 10.3
            ax.add_patch(Rectangle((tx, yy), 1.4, CELL_H, facecolor="white", edgecolor="#555555", lw=1))
            ax.text(tx + 0.7, yy + CELL_H / 2, str(physical), ha="center", va="center", fontsize=9)
            table_slots.setdefault(physical, []).append((tx + 1.4, yy + CELL_H / 2, owner[physical]))
            ax.add_patch(FancyArrowPatch((0.2 + BLOCK * CELL_W + 1.35, yy + CELL_H / 2), (tx - 0.05, yy + CELL_H / 2),
                                         arrowstyle="-|>", mutation_scale=8, color="#bbbbbb", lw=0.8))

    px = 17.2
    for block in range(NUM_BLOCKS):
        y = 7.3 - block * 0.95
        words = physical_words.get(block, [])
        colour = owner.get(block, "#e8e8e8")
        cells(ax, px, y, words + [""] * (BLOCK - len(words)),
              [colour] * len(words) + ["#e8e8e8"] * (BLOCK - len(words)), fontsize=7)
        ax.text(px - 0.2, y + CELL_H / 2, str(block), ha="right", va="center", fontsize=8, color="#555555")
        if colour == SHARED:
            ax.text(px + BLOCK * CELL_W + 0.15, y + CELL_H / 2, "shared, 2 refs", fontsize=7, va="center",
                    color=SHARED)
        elif block not in owner:
            ax.text(px + BLOCK * CELL_W + 0.15, y + CELL_H / 2, "free", fontsize=7, va="center", color="#999999")
        for sx, sy, c in table_slots.get(block, []):
            ax.add_patch(FancyArrowPatch((sx + 0.05, sy), (px - 0.55, y + CELL_H / 2), arrowstyle="-|>",
                                         mutation_scale=9, color=c, lw=1.1, connectionstyle="arc3,rad=0.0"))
    ax.text(0.2, -0.1, f"Block size {BLOCK} tokens: token t of a sequence lives in slot "
            f"block_table[t // {BLOCK}] × {BLOCK} + t % {BLOCK}.\nA new token goes into its sequence's last block, "
            "or a block taken from the free list; a shared block is copied before it is written (copy-on-write).",
            fontsize=7.5, color="#555555", va="top")
    out = pathlib.Path(__file__).with_suffix(".svg")
    fig.savefig(out, bbox_inches="tight", metadata={"Date": None})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
