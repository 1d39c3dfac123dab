"""Pictures of a :class:`eval.concepts.ConceptMap`: a PNG (``draw_concepts``) and an HTML page (``write_html``).

PNG, top to bottom: the R legend (total / text / image R with counts and mean p, the open tail, the image scan
order); the token row, text tokens on a background that alternates per concept (ConceptMoE, arXiv 2601.21420, §3.2:
a concept is the tokens up to and including its boundary token), a red bar after every boundary token, the open tail
grey, each image's slots as one box ``[image i: k tokens, c concepts]`` coloured like its regions (c: the
concepts whose boundary is one of its slots, the legend's and R's count, ``ImageConcepts.concepts``); under every token
its boundary probability p as a bar (dashed line: the 0.5 threshold). Then per image: the image as the model sees it
(resized by the image processor) with the token grid, the concept regions filled in a cycling qualitative palette with
thick borders between concepts, and p per cell with the boundaries and the scan path (``vlm.image_scan``). The HTML
page holds the same for long texts: a span per token (tooltip: index, p, concept), the images inline.

Drawn by Agg without pyplot (``eval.r_report_plot.agg_figure``): safe in scripts, threads and notebooks.
"""

# Shape suffixes (docs/paper.md §0): H x W an image's token grid, Hp x Wp its pixels, 3 RGB.

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.collections import LineCollection

from data_pipelines.schema import Modality
from eval.concepts import ConceptMap, ImageConcepts
from eval.r_report_plot import agg_figure
from vlm.image_scan import scan_cells

TEXT_COLOURS = ("#b9d4f1", "#f6d3a1")  # text concepts alternate between these
OPEN_COLOUR = "#d9d9d9"  # the open tail: tokens after the last boundary
BOUNDARY_COLOUR = "#c0392b"
_TAB20 = colormaps["tab20"].colors
PALETTE = [c for i, c in enumerate(_TAB20[0::2] + _TAB20[1::2]) if i not in (7, 17)]  # hues first, greys out
FONT_PT, CHAR_W = 10.0, 0.602  # monospace advance per char, in font sizes
FIG_W, MARGIN_IN, LINE_IN, HEAD_IN, IMAGE_IN = 15.0, 0.3, 0.4, 1.0, 3.6
MAX_LINES = 45  # token lines drawn in the PNG; the HTML page has them all


def summary_lines(cmap: ConceptMap) -> list[str]:
    """The legend: R total / text / image with counts and mean p, the open tail, the scan order."""
    s = cmap.stats

    def part(name: str, m: int) -> str:
        t, c, r = s["tokens_by_modality"].get(m, 0), s["concepts_by_modality"].get(m, 0), s["r_by_modality"].get(m)
        r_txt = "n/a" if r is None else f"{r:.2f}"
        return f"{name} R {r_txt} ({t} tokens / {c} concepts, mean p {s['mean_p_by_modality'].get(m, 0.0):.2f})"

    near = int((np.abs(cmap.p_N - 0.5) < 0.1).sum())
    mixed = sum(span.mixed for span in cmap.spans)
    return [
        f"R {s['r']:.2f} ({s['tokens']} tokens / {s['concepts']} concepts, mean p {s['mean_p']:.2f})   |   "
        + "   |   ".join((part("text", Modality.TEXT), part("image", Modality.IMAGE))),
        f"open tail: {cmap.open_tail} tokens (grey, in no concept yet)   |   {near} tokens with p within 0.1 of the "
        f"0.5 threshold   |   concepts mixing text and image: {mixed}   |   image scan order: {cmap.image_chunking}",
    ]


def image_label(img: ImageConcepts) -> str:
    """The image's box in the token strip; its counts are the legend's (``ImageConcepts.concepts``: the concepts
    closing on the image's slots, as R counts them), so that the boxes' counts sum to the legend's image counts."""
    return f"[image {img.index + 1}: {img.tokens} tokens, {img.concepts} concepts]"


def region_colour(concept: int) -> tuple[float, float, float]:
    return PALETTE[concept % len(PALETTE)] if concept >= 0 else (0.6, 0.6, 0.6)


def painted_labels(img: ImageConcepts) -> np.ndarray:
    """The concept id the region panel paints on every pixel of the resized image, [Hp, Wp] (-1: open tail)."""
    return np.repeat(np.repeat(img.labels_HW, img.cell_px, axis=0), img.cell_px, axis=1)


def region_rgb(img: ImageConcepts) -> np.ndarray:
    """The region panel's pixels [Hp, Wp, 3]: the image faded under its concepts' colours, the open tail striped."""
    labels = painted_labels(img)
    colours = np.array(PALETTE)[labels % len(PALETTE)]
    stripes = ((np.add.outer(np.arange(labels.shape[0]), np.arange(labels.shape[1])) // 4) % 2)[..., None]
    colours = np.where((labels < 0)[..., None], 0.55 + 0.3 * stripes, colours)
    base = np.asarray(img.image.convert("RGB"), dtype=float) / 255.0 if img.image is not None else 1.0
    return 0.3 * base + 0.7 * colours


# ----------------------------------------------------------------------------- the token rows
def _items(cmap: ConceptMap) -> list[tuple]:
    """(first token, last token, label) per drawn box: one per text token, one per image's run of slots."""
    items, n = [], 0
    while n < len(cmap.pieces):
        if cmap.modality_N[n] != Modality.IMAGE:
            label = cmap.pieces[n].replace("\n", "↵").replace("\t", "→") or "·"
            items.append((n, n, label))
            n += 1
            continue
        i, run = cmap.image_N[n], n
        while n < len(cmap.pieces) and cmap.image_N[n] == i:
            n += 1
        items.append((run, n - 1, image_label(cmap.images[i])))
    return items


def _layout(items: list[tuple], chars: int) -> list[tuple]:
    """(line, column, width, item) per box: boxes flow left to right and wrap; a newline token ends its line."""
    placed, line, col = [], 0, 0
    for item in items:
        width = min(chars, max(len(item[2]), 2 if item[0] != item[1] else 1))
        if col + width > chars:
            line, col = line + 1, 0
        placed.append((line, col, width, item))
        col += width
        if item[2].endswith("↵"):
            line, col = line + 1, 0
    return placed


def _draw_tokens(ax, cmap: ConceptMap, placed: list[tuple]) -> None:
    """Token boxes (concept colours, boundary bars, labels) and the p strip under them; y grows downwards."""
    boxes, bars, ticks = [], [], []  # (x, y, width, height, colour)
    for line, col, width, (first, last, label) in placed:
        k = last - first + 1
        for j, n in enumerate(range(first, last + 1)):
            x, w = col + width * j / k, width / k
            c = cmap.concept_N[n]
            if cmap.modality_N[n] == Modality.IMAGE:
                colour = (*region_colour(c), 0.55) if c >= 0 else OPEN_COLOUR
            else:
                colour = TEXT_COLOURS[c % 2] if c >= 0 else OPEN_COLOUR
            boxes.append((x + 0.03, line + 0.05, w - 0.06 if k == 1 else w, 0.5, colour))
            p = float(cmap.p_N[n])
            bars.append(
                (x + 0.1 * w, line + 0.92 - 0.3 * p, 0.8 * w, 0.3 * p, BOUNDARY_COLOUR if cmap.b_N[n] else "#7f8c8d")
            )
            if cmap.b_N[n]:
                ticks.append([(x + w, line + 0.02), (x + w, line + 0.58)])
        ax.text(col + 0.03, line + 0.3, label, fontsize=FONT_PT, family="DejaVu Sans Mono", va="center", clip_on=True)
    for rects in (boxes, bars):
        if rects:
            x, y, w, h, colour = zip(*rects)
            ax.bar(x, h, w, bottom=y, color=colour, align="edge", linewidth=0)
    ax.add_collection(LineCollection(ticks, colors=BOUNDARY_COLOUR, linewidths=2.0))
    ends = {}  # the 0.5 threshold under each line's tokens
    for line, col, width, _ in placed:
        ends[line] = max(ends.get(line, 0), col + width)
    threshold = [[(0, y + 0.77), (end, y + 0.77)] for y, end in ends.items()]
    ax.add_collection(LineCollection(threshold, colors="black", linewidths=0.6, linestyles="--"))


# ----------------------------------------------------------------------------- the image panels
def _grid_lines(ax, img: ImageConcepts, colour: str = "white") -> None:
    (h, w), s = img.grid, img.cell_px
    segs = [[(c * s, 0), (c * s, h * s)] for c in range(w + 1)] + [[(0, r * s), (w * s, r * s)] for r in range(h + 1)]
    ax.add_collection(LineCollection(segs, colors=colour, linewidths=0.5, alpha=0.8))


def concept_borders(img: ImageConcepts) -> list:
    """Segments (pixel coordinates) between 4-adjacent cells of different concepts."""
    lab, s = img.labels_HW, img.cell_px
    rows, cols = np.nonzero(lab[:, 1:] != lab[:, :-1])
    segs = [[((c + 1) * s, r * s), ((c + 1) * s, (r + 1) * s)] for r, c in zip(rows, cols)]
    rows, cols = np.nonzero(lab[1:, :] != lab[:-1, :])
    return segs + [[(c * s, (r + 1) * s), ((c + 1) * s, (r + 1) * s)] for r, c in zip(rows, cols)]


def _concept_ids(ax, img: ImageConcepts, image_chunking: str, cell_pt: float) -> None:
    """Each concept's id, written on its first cell in scan order."""
    (h, w), s = img.grid, img.cell_px
    seen = set()
    label = {"boxstyle": "round,pad=0.1", "fc": "white", "alpha": 0.8}
    for r, c in scan_cells(h, w, image_chunking).tolist():
        if (m := int(img.labels_HW[r, c])) >= 0 and m not in seen:
            seen.add(m)
            x, y = (c + 0.5) * s, (r + 0.5) * s
            ax.text(x, y, str(m), ha="center", va="center", fontweight="bold", fontsize=min(8, cell_pt / 2), bbox=label)


def _draw_image(fig, box: tuple, cmap: ConceptMap, img: ImageConcepts) -> None:
    """Three panels in ``box`` (figure fractions): the image with its grid, the concept regions, p per cell."""
    left, bottom, width, height = box
    (h, w), s = img.grid, img.cell_px
    extent = (0, w * s, h * s, 0)
    axes = [fig.add_axes((left + width * k / 3, bottom, width / 3 * 0.86, height * 0.82)) for k in range(3)]
    titles = (
        f"image {img.index + 1}: {img.size[0]}x{img.size[1]} px as the model sees it\n{h}x{w} tokens of {s} px",
        f"concepts (closing inside, as R counts): {img.concepts}, regions drawn: {len(img.concept_ids)}\n"
        + ("grey stripes: open tail" if (img.labels_HW < 0).any() else "thick lines: concept borders"),
        f"boundary p per token (red box: boundary)\nline: scan order '{cmap.image_chunking}' from ▲",
    )
    if img.image is not None:
        axes[0].imshow(np.asarray(img.image.convert("RGB")), extent=extent, interpolation="nearest")
    axes[1].imshow(region_rgb(img), extent=extent, interpolation="nearest")
    shown = axes[2].imshow(img.p_HW, extent=extent, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    for ax, title in zip(axes, titles):
        _grid_lines(ax, img)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, w * s)
        ax.set_ylim(h * s, 0)
        ax.tick_params(labelsize=7)
    axes[1].add_collection(LineCollection(concept_borders(img), colors="black", linewidths=2.2))
    box_in = axes[1].get_position()  # a cell's side on the page, in points: ids only where they fit
    cell_pt = 72 * min(box_in.width * fig.get_figwidth() / w, box_in.height * fig.get_figheight() / h)
    if cell_pt >= 12:  # the id of each concept on its first cell in scan order
        _concept_ids(axes[1], img, cmap.image_chunking, cell_pt)
    rc = scan_cells(h, w, cmap.image_chunking).numpy()
    xs, ys = (rc[:, 1] + 0.5) * s, (rc[:, 0] + 0.5) * s
    axes[2].plot(xs, ys, color="white", lw=0.9, alpha=0.7)
    axes[2].plot(xs[:1], ys[:1], marker="^", color="white", ms=7)
    rr, cc = np.nonzero(img.b_HW)
    outline = [
        [
            (c * s + d, r * s + d),
            ((c + 1) * s - d, r * s + d),
            ((c + 1) * s - d, (r + 1) * s - d),
            (c * s + d, (r + 1) * s - d),
            (c * s + d, r * s + d),
        ]
        for r, c in zip(rr, cc)
        for d in [0.06 * s]
    ]
    axes[2].add_collection(LineCollection(outline, colors=BOUNDARY_COLOUR, linewidths=2.0))
    bar = fig.colorbar(shown, ax=axes[2], fraction=0.05, pad=0.02)
    bar.ax.axhline(0.5, color="red", lw=1.5)
    bar.ax.tick_params(labelsize=7)


# ----------------------------------------------------------------------------- PNG and HTML
def draw_concepts(cmap: ConceptMap, path_png: str | Path) -> Path:
    """The PNG described in the module docstring; returns its path."""
    chars = int((FIG_W - 2 * MARGIN_IN) * 72 / (FONT_PT * CHAR_W)) - 1
    placed = _layout(_items(cmap), chars)
    n_lines = 1 + max((p[0] for p in placed), default=0)
    shown = [p for p in placed if p[0] < MAX_LINES]
    lines = min(n_lines, MAX_LINES)
    fig_h = HEAD_IN + lines * LINE_IN + len(cmap.images) * IMAGE_IN + 0.3
    fig = agg_figure(figsize=(FIG_W, fig_h), dpi=100)
    title = f"Concepts of {cmap.source}" if cmap.source else "Concepts"
    fig.text(MARGIN_IN / FIG_W, 1 - 0.25 / fig_h, title, fontsize=13, fontweight="bold", va="center")
    for k, line in enumerate(summary_lines(cmap)):
        fig.text(MARGIN_IN / FIG_W, 1 - (0.52 + 0.2 * k) / fig_h, line, fontsize=9, va="center")
    key = (
        "text: background alternates per concept; red bar = boundary (closes a concept); grey = open tail;  "
        "bars under tokens: p, red where a boundary, dashed line = 0.5"
    )
    fig.text(MARGIN_IN / FIG_W, 1 - 0.92 / fig_h, key, fontsize=8, va="center", color="#444444")
    ax = fig.add_axes(
        (
            MARGIN_IN / FIG_W,
            1 - (HEAD_IN + lines * LINE_IN) / fig_h,
            chars * FONT_PT * CHAR_W / 72 / FIG_W,
            lines * LINE_IN / fig_h,
        )
    )
    ax.set_xlim(0, chars)
    ax.set_ylim(lines, 0)
    ax.axis("off")
    _draw_tokens(ax, cmap, shown)
    if n_lines > MAX_LINES:
        rest = len(cmap.pieces) - shown[-1][3][1] - 1
        ax.text(0, lines - 0.05, f"... {rest} more tokens: see the HTML page (--html)", color="red", fontsize=9)
    for k, img in enumerate(cmap.images):
        bottom = (fig_h - HEAD_IN - lines * LINE_IN - (k + 1) * IMAGE_IN) / fig_h
        _draw_image(fig, (MARGIN_IN / FIG_W, bottom, 1 - 2 * MARGIN_IN / FIG_W, IMAGE_IN / fig_h), cmap, img)
    path_png = Path(path_png)
    fig.savefig(path_png)
    return path_png


def image_png(cmap: ConceptMap, img: ImageConcepts) -> bytes:
    """The three panels of one image as PNG bytes (for the HTML page)."""
    fig = agg_figure(figsize=(FIG_W, IMAGE_IN), dpi=90)
    _draw_image(fig, (0.02, 0.02, 0.96, 0.96), cmap, img)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


STYLE = f"""body {{font-family: sans-serif; margin: 1.5em; max-width: 90em}}
.tokens {{font-family: monospace; font-size: 14px; line-height: 2.1; white-space: pre-wrap; word-break: break-all}}
.t {{padding: 1px 0; border-right: 1px solid white}} .c0 {{background: {TEXT_COLOURS[0]}}}
.c1 {{background: {TEXT_COLOURS[1]}}} .open {{background: {OPEN_COLOUR}; color: #555}}
.b {{border-right: 3px solid {BOUNDARY_COLOUR}}} .img {{background: #e8daf5; padding: 2px 4px; text-decoration: none}}
.legend {{color: #333}} table {{border-collapse: collapse; font-size: 13px}} td, th {{border: 1px solid #ccc;
padding: 2px 6px}} td.x {{font-family: monospace; white-space: pre-wrap}}"""


def write_html(cmap: ConceptMap, path_html: str | Path, png: str | Path | None = None) -> Path:
    """One page: legend, every token as a span (tooltip: index, p, concept; a red underline as strong as p, a thick
    red edge on boundaries, grey open tail), each image's panels inline, and the table of concepts."""
    esc = html.escape
    out = [
        f"<!doctype html><meta charset='utf-8'><title>Concepts</title><style>{STYLE}</style>",
        f"<h2>Concepts of {esc(cmap.source or 'the input')}</h2>",
    ]
    out += [f"<p class='legend'>{esc(line)}</p>" for line in summary_lines(cmap)]
    out.append(
        "<p class='legend'>Hover a token for its p. Background alternates per concept; thick red edge = "
        "boundary; underline strength = p; grey = open tail.</p>"
    )
    if png is not None:
        out.append(f"<p><a href='{esc(Path(png).name)}'>the PNG</a></p>")
    tokens = []  # one string: the div keeps white space
    for first, last, label in _items(cmap):
        if first != last or cmap.modality_N[first] == Modality.IMAGE:
            i, closing = cmap.image_N[first], int(cmap.b_N[first : last + 1].sum())
            tip = (
                f"tokens {first}-{last} · {closing} boundaries inside · mean p={cmap.p_N[first : last + 1].mean():.3f}"
            )
            tokens.append(f"<a class='img' href='#image-{i + 1}' title='{tip}'>{esc(label)}</a>")
            continue
        n, c = first, cmap.concept_N[first]
        classes = f"t {'open' if c < 0 else f'c{c % 2}'}{' b' if cmap.b_N[n] else ''}"
        tip = f"token {n} · p={cmap.p_N[n]:.3f} · " + (f"concept {c}" if c >= 0 else "open tail")
        shadow = f"box-shadow: inset 0 -3px rgba(192,57,43,{cmap.p_N[n]:.2f})"
        text = esc(cmap.pieces[n]).replace("\n", "↵\n") or "·"
        tokens.append(f"<span class='{classes}' style='{shadow}' title='{tip}'>{text}</span>")
    out.append(f"<div class='tokens'>{''.join(tokens)}</div>")
    for img in cmap.images:
        data = base64.b64encode(image_png(cmap, img)).decode()
        out.append(f"<h3 id='image-{img.index + 1}'>Image {img.index + 1}</h3><img src='data:image/png;base64,{data}'>")
    out.append(
        f"<details><summary>all {len(cmap.spans)} concepts</summary><table><tr><th>id</th><th>tokens</th>"
        "<th>modality</th><th>p at boundary</th><th>text</th></tr>"
    )
    for s in cmap.spans:
        kind = ("image" if s.modality == Modality.IMAGE else "text") + (" (mixed)" if s.mixed else "")
        out.append(
            f"<tr><td>{s.id}</td><td>{s.start}-{s.end}</td><td>{kind}</td><td>{s.p:.3f}</td>"
            f"<td class='x'>{esc(s.text)}</td></tr>"
        )
    out.append("</table></details>")
    path_html = Path(path_html)
    path_html.write_text("\n".join(out), encoding="utf-8")
    return path_html
