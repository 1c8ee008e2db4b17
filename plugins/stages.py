"""The default startup and step stages, registered as an ordinary plugin.

Each hook hands the step to the matching function of
:mod:`dspark_core.engine.step`. A plugin that wants to replace a stage
registers its own ``firstresult`` implementation (it runs first when
registered later) or blocks this one with ``--plugin no:stages`` and provides
all four.
"""

from __future__ import annotations

from dspark_core.engine import step as stages
from dspark_core.hookspecs import hookimpl


@hookimpl(trylast=True)
def dspark_warmup(runtime):
    runtime.runner.warmup(runtime.geometry)


@hookimpl(trylast=True)
def dspark_propose(step):
    return stages.propose(step)


@hookimpl(trylast=True)
def dspark_select_budget(step, proposal):
    return stages.select_budget(step, proposal)


@hookimpl(trylast=True)
def dspark_verify(step, proposal, budget):
    return stages.verify(step, proposal, budget)


@hookimpl(trylast=True)
def dspark_commit(step, verification):
    stages.commit(step, verification)


@hookimpl(trylast=True)
def dspark_calibrate(runtime, plan):
    from dspark_core.calibration import install

    return install.calibrate(runtime, plan)


@hookimpl(trylast=True)
def dspark_fit(runtime, plan, samples):
    from dspark_core.calibration import install

    return install.fit(runtime, plan, samples)


@hookimpl(trylast=True)
def dspark_install_table(runtime, table):
    from dspark_core.calibration import install

    install.install(runtime, table)
