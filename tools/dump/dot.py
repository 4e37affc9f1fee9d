"""`metatp dump --format dot|svg`: one cluster per subgraph, nodes coloured by split state."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from metatp.ir.errors import MetatpError
from metatp.ir.tensor import Flag, Tensor
from metatp.passes.memory import format_bytes
from metatp.tools.dump.view import tensor_kind, is_plain_view, shape_text, flags_text, PlanView
from metatp.tools.dump.text import state_text, header_text


# ---------------------------------------------------------------- dot / svg


STATE_COLOURS = {"MIRRORED": "#e6e6e6", "PARTIAL": "#f4a582", "AXIS_0": "#92c5de", "AXIS_1": "#a6dba0",
                 "AXIS_2": "#c2a5cf", "AXIS_3": "#fee08b", "-": "#ffffff"}


def _colour(tp) -> str:
    if tp is None:
        return STATE_COLOURS["-"]
    return STATE_COLOURS[str(tp.state).split("[", 1)[0].split("{", 1)[0]]


def _dot_attrs(view: PlanView, t: Tensor) -> dict[str, str]:
    """Weights small boxes, KV cache cylinders, inputs parallelograms, views faint, ops rounded."""
    tp = view.tp(t)
    state = state_text(tp)
    fill = _colour(tp)
    kind = tensor_kind(t)
    if kind != "node":
        shape = {"weight": "box", "kv_cache": "cylinder", "input": "parallelogram"}.get(kind, "box")
        return {"label": f"{t.name}\n{shape_text(t.ne)} {t.type.name}\n{state}", "shape": shape, "style": "filled",
                "fillcolor": fill, "fontsize": "8", "height": "0.2", "margin": "0.04,0.02"}
    i = view.graph.index[t]
    label = f"#{i} {t.op.name}\n{view.label(t)}\n{shape_text(t.ne)}\n{state}"
    if tp is not None and not all(tp.compute):
        label += f"\ncompute={flags_text(tp.compute)}"
    if is_plain_view(t):
        return {"label": f"#{i} {t.op.name}\n{view.label(t)}\n{state}", "shape": "ellipse",
                "style": "dashed,filled", "fillcolor": fill, "color": "gray60", "fontcolor": "gray40",
                "fontsize": "7", "height": "0.2"}
    attrs = {"label": label, "shape": "box", "style": "rounded,filled", "fillcolor": fill, "fontsize": "10"}
    if i in view.reduction_of:
        attrs.update({"color": "#b2182b", "penwidth": "3", "peripheries": "2"})
    return attrs


def _to_networkx(view: PlanView):
    """The shown part of the plan as a networkx DiGraph with Graphviz attributes; sources from
    outside the shown nodes appear as faint context nodes, each all-reduce as a red node."""
    import networkx as nx

    g = view.graph
    shown = {g.nodes[i] for i in view.nodes} | set(view.leaves)
    nxg = nx.DiGraph(name=g.name)
    for t in view.leaves:
        nxg.add_node(view.id[t], cluster=_leaf_cluster(view, t), **_dot_attrs(view, t))
    for i in view.nodes:
        n = g.nodes[i]
        nxg.add_node(view.id[n], cluster=view.subgraph_of.get(i), **_dot_attrs(view, n))
        for s in n.src:
            if s is None:
                continue
            if s not in shown:
                nxg.add_node(view.id[s], cluster=None, label=f"{view.label(s)}\n{state_text(view.tp(s))}",
                             shape="plaintext", fontcolor="gray40", fontsize="8")
            style = "dashed" if is_plain_view(n) else "solid"
            nxg.add_edge(view.id[s], view.id[n], style=style, color="gray50" if style == "dashed" else "black")
        if i in view.reduction_of:
            rid, k, r = view.reduction_of[i]
            rn = f"r{rid}"
            nxg.add_node(rn, cluster=k, label=f"all-reduce #{rid}\n{format_bytes(r.nbytes)}\ncovers {r.covers}",
                         shape="octagon", style="filled", fillcolor="#b2182b", fontcolor="white", fontsize="9")
            nxg.add_edge(view.id[n], rn, color="#b2182b", penwidth="2")
    return nxg


def _leaf_cluster(view: PlanView, t: Tensor) -> int | None:
    """A weight is drawn inside its consumers' subgraph when they all share one (tidier layout)."""
    if t.flags & Flag.INPUT:
        return None
    clusters = {view.subgraph_of.get(i) for i in view.nodes if t in view.graph.nodes[i].src}
    return clusters.pop() if len(clusters) == 1 else None


def _dot_quote(s: Any) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_attr_list(attrs: dict) -> str:
    return ", ".join(f"{k}={_dot_quote(v)}" for k, v in attrs.items() if k != "cluster" and v is not None)


_LEGEND = [("MIRRORED", "box", "rounded,filled"), ("PARTIAL", "box", "rounded,filled"),
           ("AXIS_0", "box", "rounded,filled"), ("AXIS_1", "box", "rounded,filled"),
           ("AXIS_2", "box", "rounded,filled"), ("AXIS_3", "box", "rounded,filled")]


def _legend_lines() -> list[str]:
    lines = ["  subgraph cluster_legend {", '    label="legend"; style="rounded"; color="gray70"; fontsize="10";']
    names = []
    for k, (state, shape, style) in enumerate(_LEGEND):
        names.append(f"legend{k}")
        lines.append(f"    legend{k} [label={_dot_quote(state)}, shape={shape}, style={_dot_quote(style)},"
                     f" fillcolor={_dot_quote(STATE_COLOURS[state])}, fontsize=9];")
    extras = [("weight (small box)", "box", "filled", "#ffffff", "8"),
              ("KV cache", "cylinder", "filled", "#ffffff", "8"),
              ("view (no compute)", "ellipse", "dashed,filled", "#ffffff", "7"),
              ("all-reduce", "octagon", "filled", "#b2182b", "9")]
    for k, (text, shape, style, fill, size) in enumerate(extras, start=len(_LEGEND)):
        names.append(f"legend{k}")
        font = ', fontcolor="white"' if fill == "#b2182b" else ""
        lines.append(f"    legend{k} [label={_dot_quote(text)}, shape={shape}, style={_dot_quote(style)},"
                     f" fillcolor={_dot_quote(fill)}, fontsize={size}{font}];")
    lines.append("    " + " -> ".join(names) + " [style=invis];")
    lines.append("  }")
    return lines


def format_dot(view: PlanView, info: dict) -> str:
    nxg = _to_networkx(view)
    title = "\n".join(line.removeprefix("# ") for line in header_text(info))
    lines = [f"digraph {_dot_quote(view.graph.name)} {{",
             f"  graph [rankdir=TB, label={_dot_quote(title)}, labelloc=t, labeljust=l, fontsize=11, nodesep=0.2,"
             f" ranksep=0.3, fontname=Helvetica];",
             '  node [fontname=Helvetica];', '  edge [arrowsize=0.6];']
    by_cluster: dict[int | None, list[str]] = {}
    for key, attrs in nxg.nodes(data=True):
        by_cluster.setdefault(attrs.get("cluster"), []).append(f"{_dot_quote(key)} [{_dot_attr_list(attrs)}];")
    for k in sorted(c for c in by_cluster if c is not None):
        sg = view.plan.subgraphs[k]
        red = " -> all-reduce" if sg.reduction is not None else ""
        lines.append(f"  subgraph cluster_sg{k} {{")
        lines.append(f"    label={_dot_quote(f'subgraph {k}: nodes {sg.start}..{sg.end}{red}')};"
                     ' style="dashed,rounded"; color="gray50"; fontsize=9;')
        lines += [f"    {s}" for s in by_cluster[k]]
        lines.append("  }")
    lines += [f"  {s}" for s in by_cluster.get(None, [])]
    for a, b, attrs in nxg.edges(data=True):
        lines.append(f"  {_dot_quote(a)} -> {_dot_quote(b)} [{_dot_attr_list(attrs)}];")
    lines += _legend_lines()
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_text: str) -> str:
    """SVG through Graphviz's `dot`; a clear error when it is not installed."""
    exe = shutil.which("dot")
    if exe is None:
        raise MetatpError("--format svg needs Graphviz's `dot`: install it (apt-get install graphviz, "
                          "or brew install graphviz), or use --format dot")
    proc = subprocess.run([exe, "-Tsvg"], input=dot_text.encode("utf-8"), capture_output=True)
    if proc.returncode != 0:
        msg = proc.stderr.decode("utf-8", errors="replace").strip().splitlines()
        raise MetatpError(f"Graphviz dot failed: {msg[-1] if msg else 'exit status ' + str(proc.returncode)}")
    return proc.stdout.decode("utf-8")
