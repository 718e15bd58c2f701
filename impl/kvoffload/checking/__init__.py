"""The checking harnesses, together: everything that checks a manager against the spec.

- :mod:`kvoffload.checking.lockstep`: the one lockstep driver (an operation applied to a
  system and to the model, everything compared);
- :mod:`kvoffload.checking.conformance`: the conformance kit (``check_conformance``), a
  Hypothesis machine that draws operations for the driver;
- :mod:`kvoffload.checking.contracts`: the manager's CrossHair contracts, one commuting
  square per operation;
- :mod:`kvoffload.checking.verify`: ``kvoffload verify``, exploration then conformance.

The model they check against (``kvoffload_spec``: the state machine, its operations, the
refinement mapping, the explorer) stays standard library only. Nothing here is imported by
``from kvoffload import OffloadManager, Offloader``. See docs/checking.md.
"""
