"""The drawing helpers the chapters use (matplotlib, imported only by the modules that draw).

One module per subject: :mod:`~dcp_ref.viz.ownership` and :mod:`~dcp_ref.viz.interleave` (who owns which token),
:mod:`~dcp_ref.viz.topk` (the radix passes), :mod:`~dcp_ref.viz.deinterleave`, :mod:`~dcp_ref.viz.index_cache`,
:mod:`~dcp_ref.viz.fp8_row` (one FP8 KV-cache row),
:mod:`~dcp_ref.viz.attention`, :mod:`~dcp_ref.viz.dataflow` (what a layer moves), :mod:`~dcp_ref.viz.step_parts`
(the planned step as one part per option axis) and :mod:`~dcp_ref.viz.perf` (the benchmarks' figures).
"""
