"""Each kernel's marginal cost inside a captured batch-1 decode graph.

  python tools/profile_graph_nodes.py [--model moe|hybrid|llama] [--layers N] [--replays 20]

Nsight Compute times launches one at a time (serialized, caches and clocks its own) and nsys
does not run on the lent machines, so neither says where a graph replay spends its time. This
tool measures inside the graph. It brings the model of bench_decode.py, bench_moe.py or
bench_hybrid.py (random bf16 weights on the device) to batch-1 decode after a 128-token prompt,
keeping the template of every graph the engine captures, then groups the replayed graph's
kernel nodes by kernel and times back-to-back replays of executable graphs made from the template with
- every node on: the step;
- one group's nodes off (cuGraphNodeSetEnabled): the step less the group, whose difference is
  the group's marginal cost in the step (its own time, and the gaps it adds);
- only that group's nodes on: the group alone, less the empty graph's time.
Each configuration gets an executable graph of its own, instantiated from the template, whose
nodes are only ever switched off, so that no timing depends on the switches made before it
(session 25's first map switched one executable graph's nodes off and on again, and its full
Qwen3-Next step, timed between the groups, drifted from 935 to 1054 us on an H100). A disabled
kernel leaves its outputs as the last full replay wrote them, so the kernels after it read
valid data. The step's time minus the sum of the marginal costs is what no single kind of
kernel accounts for.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode  # noqa: E402
from bench_common import best_seconds  # noqa: E402
from cuda.bindings import driver  # noqa: E402
from profile_served_step import built_model, model_parser  # noqa: E402

from sparkd import SamplingParams  # noqa: E402
from sparkd.backend.cuda import graphs  # noqa: E402
from sparkd.backend.cuda.driver import call  # noqa: E402
from sparkd.engine.model_runner import prepare_inputs  # noqa: E402

PROMPT_LEN = 128
KERNEL = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL


class TemplateKeepingDriver:
    """cuda.bindings.driver as graphs.py sees it, but each captured graph is kept after its
    instantiation (in `templates`, by the executable graph's handle) rather than destroyed:
    cuGraphNodeSetEnabled names nodes by the template's handles."""

    def __init__(self):
        self.templates: dict[int, driver.CUgraph] = {}

    def __getattr__(self, name: str):
        return getattr(driver, name)

    def cuGraphInstantiate(self, graph: driver.CUgraph, flags: int):
        result = driver.cuGraphInstantiate(graph, flags)
        self.templates[int(result[1])] = graph
        return result

    def cuGraphDestroy(self, graph: driver.CUgraph):
        return (driver.CUresult.CUDA_SUCCESS,)


def demangled(name: str) -> str:
    """The kernel's (namespaced) identifier from an Itanium-mangled name; other names unchanged."""
    nested = name.startswith("_ZN")
    if not name.startswith("_Z"):
        return name
    parts, i = [], 3 if nested else 2
    while match := re.match(r"\d+", name[i:]):
        length = int(match.group())
        start = i + len(match.group())
        parts.append(name[start:start + length])
        i = start + length
        if not nested:
            break
    return "::".join(parts) or name


def kernel_label(node: driver.CUgraphNode) -> str:
    """The node's kernel name and grid: the launches of one kernel at different shapes (the qkv,
    o and lm_head GEMVs, say) fall in different groups."""
    params = call(driver.cuGraphKernelNodeGetParams, node)
    name = "?"
    for getter, handle in ((driver.cuFuncGetName, params.func), (driver.cuKernelGetName, params.kern)):
        if handle is not None and int(handle):
            status, raw = getter(handle)
            if status == driver.CUresult.CUDA_SUCCESS:
                name = demangled(raw.decode() if isinstance(raw, bytes) else str(raw))
                break
    return f"{name} [{params.gridDimX}x{params.gridDimY}x{params.gridDimZ}]"


def kernel_nodes(graph: driver.CUgraph) -> list[tuple[str, driver.CUgraphNode]]:
    """(kernel_label, node) of the graph's kernel nodes, in the order of capture."""
    _, count = call(driver.cuGraphGetNodes, graph, 0)
    nodes, _ = call(driver.cuGraphGetNodes, graph, count)
    return [(kernel_label(node), node) for node in nodes if call(driver.cuGraphNodeGetType, node) == KERNEL]


def decode_step_graph(model, templates: dict[int, driver.CUgraph]) -> tuple[graphs.CudaGraph, driver.CUgraph]:
    """The executable graph of the model's next batch-1 decode step and its template (from
    `templates`: TemplateKeepingDriver's), with the engine brought there by a PROMPT_LEN-token
    prompt and bench_decode's warm-up steps."""
    replayed: list[graphs.CudaGraph] = []
    replay = graphs.CudaGraph.replay
    graphs.CudaGraph.replay = lambda graph, stream: (replayed.append(graph), replay(graph, stream))[1]
    engine, rng = model.engine, np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.add_request(rng.integers(0, model.config.vocab_size, PROMPT_LEN).tolist(), params)
    for _ in range(1 + bench_decode.WARMUP_STEPS):
        engine.step()
    output = engine.schedule()
    runner = engine.runner
    inputs = prepare_inputs(output.scheduled, runner.block_table, engine.args.block_size, runner.uses_state_slots)
    assert inputs.is_decode, "the next step is not a decode step"
    replayed.clear()
    runner.decode_graphs.run(runner.decode_forward, inputs.token_ids, inputs.positions, inputs.attn)
    graphs.CudaGraph.replay = replay
    assert len(replayed) == 1, f"the step replayed {len(replayed)} graphs"
    return replayed[0], templates[int(replayed[0].graph_exec)]


def main(argv: list[str] | None = None) -> int:
    parser = model_parser(__doc__, "moe")
    parser.add_argument("--replays", type=int, default=20, help="back-to-back replays a timing")
    args = parser.parse_args(argv)
    keeping = TemplateKeepingDriver()
    graphs.driver = keeping  # before the engine captures any graph
    ops, copy_rate, model = built_model(args, 32)
    graph, template = decode_step_graph(model, keeping.templates)
    stream = ops.stream
    nodes = kernel_nodes(template)
    groups: dict[str, list[driver.CUgraphNode]] = {}
    for name, node in nodes:
        groups.setdefault(name, []).append(node)
    everything = [node for _, node in nodes]

    def step_us(off: list[driver.CUgraphNode]) -> float:
        """The step's replay time in us, on a fresh executable graph with the `off` nodes disabled."""
        fresh = graphs.CudaGraph(call(driver.cuGraphInstantiate, template, 0))
        try:
            for node in off:
                call(driver.cuGraphNodeSetEnabled, fresh.graph_exec, node, 0)

            def replays() -> None:
                for _ in range(args.replays):
                    fresh.replay(stream)
            return 1e6 * best_seconds(stream, replays, reps=5) / args.replays
        finally:
            stream.synchronize()
            fresh.destroy()

    graph.replay(stream)  # the engine's own executable graph, once: every output is a full step's
    empty = step_us(everything)
    full = [step_us([])]
    rows = []
    for name, members in groups.items():
        without = step_us(members)
        full.append(step_us([]))
        alone = step_us([node for node in everything if node not in members]) - empty
        rows.append((name, len(members), (full[-2] + full[-1]) / 2 - without, alone))
    step = statistics.median(full)
    floor_us = 1e6 * model.step_weight_bytes(1) / copy_rate
    print(f"\n{args.model}, {model.config.num_layers} layers, batch 1 after {PROMPT_LEN} tokens: {len(nodes)} kernel nodes; "
          f"step {step:.1f} us (replays {min(full):.1f}-{max(full):.1f}), weights at the copy rate {floor_us:.1f} us "
          f"({floor_us / step:.3f}); all kernels off {empty:.1f} us\n")
    print("| kernel | launches | marginal us | a launch | alone us | a launch |\n| --- | --- | --- | --- | --- | --- |")
    for name, count, marginal, alone in sorted(rows, key=lambda row: -row[2]):
        print(f"| {name} | {count} | {marginal:.1f} | {marginal / count:.2f} | {alone:.1f} | {alone / count:.2f} |")
    unexplained = step - sum(row[2] for row in rows)
    print(f"\nsum of marginal costs {step - unexplained:.1f} us; the step less that {unexplained:.1f} us")
    print("the full step between the groups, in order (us): " + ", ".join(f"{us:.0f}" for us in full))
    print("the graph's first 16 kernels, in its order: " + ", ".join(name for name, _ in nodes[:16]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
