"""python -m distca.torch.trace_report FILE [--json]: a distca trace (the trainer's --trace)
summed per rank: the step's phases, the time inside cad_attention and the server kernels, and
the exchanges: how long they were in flight and the share of that the server kernels hid (the
exchange time during which a kernel of the same rank ran; ping-pong's overlap). A trace of the
C++ trainer (distca train --trace) is summed by the step record's parts its spans name: each
span's own time, less the spans inside it.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from .trace import FORMAT

PHASES = ("planning", "forward", "backward (and the gradient all-reduce)", "optimizer")
PARTS = ("linear", "attention", "comm", "wait", "optimizer", "other")   # distca train's spans (args.part)
PASSES = ("forward pass", "backward pass", "ping-pong schedule")   # its spans that hold a pass's others
PIPELINE_PHASES = ("pipeline", "gradient sync and optimizer")   # --pp: the ticks, then the rest
KERNELS = ("server kernel forward", "server kernel backward")


def _union(spans: list) -> list:
    """Intervals [(start, end)] -> their union, sorted and disjoint."""
    out: list = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(spans: list) -> float:
    return sum(e - s for s, e in spans)


def _overlap(a: list, b: list) -> float:
    """The length of the intersection of two unions."""
    total, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += max(0.0, min(e, b[k][1]) - max(s, b[k][0]))
            k += 1
    return total


def _self_times(spans: list) -> dict:
    """Main-track spans [(start, end, part)] -> seconds per part of each span's own time (its
    length less its direct children's); a span without a part ("step") keeps what no span inside
    it covers, as "unspanned"."""
    out: dict = {}
    stack: list = []
    spans = sorted(spans, key=lambda x: (x[0], -x[1]))
    own = [e - s for s, e, _ in spans]
    for i, (s, e, _) in enumerate(spans):
        while stack and spans[stack[-1]][1] <= s:
            stack.pop()
        if stack and e <= spans[stack[-1]][1]:
            own[stack[-1]] -= e - s
        stack.append(i)
    for (_, _, part), t in zip(spans, own):
        key = part or "unspanned"
        out[key] = out.get(key, 0.0) + t
    return out


def summarize(doc: dict) -> dict:
    """A trace document -> per rank (and backend): seconds per phase, attention and kernels, and
    the exchanges' time in flight with the share the kernels hid."""
    other = doc.get("otherData", {})
    if not isinstance(doc.get("traceEvents"), list) or other.get("format") != FORMAT:
        raise ValueError(f"not a distca trace (otherData.format is not {FORMAT!r}): write one with --trace")
    by: dict = {}
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        backend = str(ev.get("args", {}).get("step", "")).split(" ")[-1]
        key = (int(ev["pid"]), backend)
        by.setdefault(key, []).append((ev["name"], ev["cat"], float(ev["ts"]) / 1e6, float(ev["dur"]) / 1e6,
                                       ev.get("args", {}).get("part")))
    ranks = []
    for (rank, backend), events in sorted(by.items()):
        sums: dict = {}
        for name, cat, _, dur, _ in events:
            if cat == "main":
                sums[name] = sums.get(name, 0.0) + dur
        exchange = _union([(t, t + d) for _, cat, t, d, _ in events if cat == "exchange"])
        kernels = _union([(t, t + d) for name, _, t, d, _ in events if name in KERNELS])
        parts = None
        if any(part is not None for *_, part in events):   # distca train's: spans name their part
            parts = _self_times([(t, t + d, part or "") for _, cat, t, d, part in events if cat == "main"])
            # What hides an exchange there: any compute of the rank, its linear work as well.
            kernels = _union([(t, t + d) for name, cat, t, d, part in events
                              if cat == "main" and part in ("linear", "attention") and name not in PASSES])
        flight = _length(exchange)
        steps = sum(1 for name, *_ in events if name == "step")
        ranks.append({"rank": rank, "backend": backend, "steps": steps, "step_seconds": sums.get("step", 0.0),
                      "phases": {p: sums[p] for p in PHASES + PIPELINE_PHASES if p in sums},
                      "ticks": sum(1 for name, *_ in events if name.startswith("tick ") and "planning" not in name
                                   and "agreement" not in name),
                      "attention_seconds": sum(v for k, v in sums.items() if k.startswith("cad_attention")),
                      "kernel_seconds": sum(sums.get(k, 0.0) for k in KERNELS),
                      "exchange_seconds": flight,
                      "exchange_hidden_share": _overlap(exchange, kernels) / flight if flight > 0 else 0.0})
        if parts is not None:
            ranks[-1]["parts"] = parts
    return {"format": "distca-trace-summary", "version": 1, "ranks": ranks}


COLOURS = (("server kernel", "#d62728"), ("cad_attention", "#ff9896"), ("exchange", "#1f77b4"),
           ("layer: feed-forward", "#2ca02c"), ("layer: attention", "#98df8a"), ("planning", "#9467bd"),
           ("optimizer", "#8c564b"), ("tick", "#bcbd22"), ("forward", "#dddddd"), ("backward", "#c7c7c7"), ("step", "#f7f7f7"))
NESTING = (("step",), ("forward", "backward", "planning", "optimizer", "pipeline", "gradient sync", "ping-pong"), ("tick ",),
           ("layer",), ("cad_attention",), ("server kernel",))


def _colour(name: str) -> str:
    return next((c for prefix, c in COLOURS if name.startswith(prefix)), "#7f7f7f")


def _depth(name: str, cat: str) -> int:
    if cat == "exchange":
        return 0
    return next((i for i, prefixes in enumerate(NESTING) if name.startswith(prefixes)), len(NESTING))


def svg(doc: dict, step: str, width: int = 1200) -> str:
    """One step's timeline (its label, as the events' args.step: "4 cad") as an SVG: a band a rank
    and track, spans nested by depth, exchanges below the rank's main track."""
    events = [ev for ev in doc["traceEvents"] if ev.get("ph") == "X" and ev.get("args", {}).get("step") == step]
    if not events:
        raise ValueError(f"no spans of step {step!r} in the trace (the steps kept: "
                         f"{sorted({ev['args']['step'] for ev in doc['traceEvents'] if ev.get('ph') == 'X'})})")
    t0 = min(ev["ts"] for ev in events)
    t1 = max(ev["ts"] + ev["dur"] for ev in events)
    scale = (width - 120) / max(t1 - t0, 1e-9)
    row, ranks = 9, sorted({ev["pid"] for ev in events})
    band = row * (len(NESTING) + 1) + 2 * row + 16
    height = 40 + band * len(ranks) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11">', f'<text x="10" y="20">step {step}: {(t1 - t0) / 1e6:.3f} s; a band a rank: the main '
           f'track (spans nested downwards), then the exchanges in flight</text>']
    for i, rank in enumerate(ranks):
        top = 40 + i * band
        out.append(f'<text x="10" y="{top + 12}">rank {rank}</text>')
        for ev in sorted((e for e in events if e["pid"] == rank), key=lambda e: -e["dur"]):
            if ev["cat"] == "exchange":
                y = top + row * (len(NESTING) + 1) + 8
            else:
                y = top + row * _depth(ev["name"], ev["cat"])
            x = 110 + (ev["ts"] - t0) * scale
            w = max(ev["dur"] * scale, 0.5)
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" fill="{_colour(ev["name"])}">'
                       f'<title>{ev["name"]} {ev["dur"] / 1e3:.2f} ms</title></rect>')
    y = height - 22
    x = 10
    for prefix, colour in COLOURS:
        out.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{colour}"/><text x="{x + 14}" y="{y + 9}">'
                   f'{prefix}</text>')
        x += 14 + 7 * len(prefix) + 12
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distca.torch.trace_report", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", metavar="FILE", help="a trace written by python -m distca.torch.train --trace FILE or "
                                                 "distca train --trace FILE")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--svg", metavar="OUT", help="draw one step's timeline as an SVG file (with --step)")
    p.add_argument("--step", metavar="'N BACKEND'", help="the step --svg draws, e.g. '4 cad' (default: the last kept)")
    a = p.parse_args(argv)
    try:
        with open(a.trace, encoding="utf-8") as f:
            doc = json.load(f)
        summary = summarize(doc)
        if a.svg:
            labels = [ev["args"]["step"] for ev in doc["traceEvents"] if ev.get("ph") == "X"]
            picture = svg(doc, a.step or labels[-1])
            from distca import _distca
            _distca.write_file_atomic(a.svg, picture)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        print(f"{p.prog}: error: {a.trace}: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(summary, indent=1))
        return 0
    if summary["ranks"] and "parts" in summary["ranks"][0]:   # distca train's trace
        print(f"{'rank':>4} {'backend':<10} {'steps':>5} {'step (s)':>9} " + " ".join(f"{p:>9}" for p in PARTS)
              + f" {'unspanned':>9} {'exch.':>7} {'hidden':>7}")
        for r in summary["ranks"]:
            print(f"{r['rank']:>4} {r['backend']:<10} {r['steps']:>5} {r['step_seconds']:>9.3f} "
                  + " ".join(f"{r['parts'].get(p, 0.0):>9.3f}" for p in PARTS)
                  + f" {r['parts'].get('unspanned', 0.0):>9.3f} {r['exchange_seconds']:>7.3f} "
                  f"{100 * r['exchange_hidden_share']:>6.0f}%")
        print("seconds summed over the steps kept, each span's own time (less the spans inside it) by the step "
              "record's part it names; unspanned: the step's time no span covers (bookkeeping, counted in other); "
              "exch.: the exchanges' time in flight (their union); hidden: the share of it during which the rank "
              "computed (linear work or a server kernel)")
        return 0
    print(f"{'rank':>4} {'backend':<10} {'steps':>5} {'step (s)':>9} {'plan':>7} {'fwd':>7} {'bwd':>7} {'optim':>7} "
          f"{'attn':>7} {'kernels':>8} {'exch.':>7} {'hidden':>7}")
    for r in summary["ranks"]:
        ph = r["phases"]
        if "pipeline" in ph:   # --pp: the ticks (planning, passes, serving) are the pipeline's
            parts = f"{'':>7} {'pipeline ' + format(ph['pipeline'], '.3f'):>15} {ph['gradient sync and optimizer']:>7.3f}"
        else:
            parts = (f"{ph['planning']:>7.3f} {ph['forward']:>7.3f} {ph[PHASES[2]]:>7.3f} {ph['optimizer']:>7.3f}")
        print(f"{r['rank']:>4} {r['backend']:<10} {r['steps']:>5} {r['step_seconds']:>9.3f} {parts} "
              f"{r['attention_seconds']:>7.3f} {r['kernel_seconds']:>8.3f} {r['exchange_seconds']:>7.3f} "
              f"{100 * r['exchange_hidden_share']:>6.0f}%")
    print("seconds summed over the steps kept; exch.: the exchanges' time in flight (posted to completed, their "
          "union); hidden: the share of it during which a server kernel of the rank ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
