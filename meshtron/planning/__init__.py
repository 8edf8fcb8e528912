"""``meshtron plan``: the parallel layout chosen by a model of step time (``step_time``), over the
layouts ``layouts`` enumerates and ``validation`` accepts, pruned by ``meshtron estimate``
(``search``), on a machine's calibrated rates (``hardware``, ``calibrate``), printed by ``report``
and checked against the real trainer by ``measure``."""
