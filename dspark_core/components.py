"""Named components that plugins declare through ``dspark_components``."""

from __future__ import annotations

from attrs import frozen

#: The kinds of component a plugin can provide, with the selection hook each uses.
KINDS: dict[str, str] = {
    "device": "dspark_device",
    "graph_backend": "dspark_graph_backend",
    "cost_model": "dspark_cost_model",
    "budget_policy": "dspark_budget_policy",
    "model_family": "dspark_model_family",
}


@frozen
class Component:
    """One selectable component: ``kind`` is a key of :data:`KINDS`.

    ``auto_priority`` is for devices only: ``--device=auto`` tries the devices
    that declare one, highest first, and takes the first that is usable here;
    a device without one is used only when asked for by name.
    """

    kind: str
    name: str
    summary: str = ""
    auto_priority: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown component kind {self.kind!r}; expected one of {sorted(KINDS)}")
        if self.auto_priority is not None and self.kind != "device":
            raise ValueError(f"auto_priority is for devices only, not for the {self.kind} {self.name!r}")
