"""The trace-replay tool: what ``kvoffload simulate`` and ``kvoffload sweep`` run.

- :mod:`~kvoffload.replay.traces`: request traces (the bundled Mooncake ones, your own files,
  traces made from token ids);
- :mod:`~kvoffload.replay.device_cache`: the engine's device prefix cache in front of the CPU
  tier;
- :mod:`~kvoffload.replay.belady`: Belady's offline optimum on the same key stream, the upper
  bound every policy is set against;
- :mod:`~kvoffload.replay.sweep`: hit ratios of policies over cache sizes (bookkeeping only);
- :mod:`~kvoffload.replay.simulate`: the replay through a small serving engine with real
  tensors, the data path and the tiers (sized by :mod:`~kvoffload.replay.config`), and
  :mod:`~kvoffload.replay.report` what it measured (:mod:`~kvoffload.replay.timing`: each
  manager call timed).
"""
