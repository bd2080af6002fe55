"""Colocation: several roles in one process on one pool (veRL's WorkerDict).

    cls = create_colocated_worker_cls({"actor_rollout": ClassWithInitArgs(ActorRolloutWorker, cfg),
                                       "critic": ClassWithInitArgs(CriticWorker, cfg)})
    wg = WorkerGroup(resource_pool=pool, cls_with_init=cls)
    wgs = wg.spawn(prefix_set={"actor_rollout", "critic"})
    wgs["critic"].compute_values(batch)        # same as wg.critic_compute_values(batch)

Every rank of the pool builds one instance of each role (in the dict's order), so the roles
share the process, its device and its process group (e.g. the actor's FSDP model and the
rollout engine, or actor, reference and critic on all ranks by default).
"""

from __future__ import annotations

from collections.abc import Mapping

from tinyzero.single_controller.decorator import MAGIC_ATTR, get_method_spec
from tinyzero.single_controller.worker import Worker
from tinyzero.single_controller.worker_group import ROLE_ATTR, ClassWithInitArgs

__all__ = ["create_colocated_worker_cls"]


def _forward(role: str, name: str, spec):
    def method(self, *args, **kwargs):
        return getattr(self.worker_dict[role], name)(*args, **kwargs)

    method.__name__ = f"{role}_{name}"
    setattr(method, MAGIC_ATTR, spec)
    setattr(method, ROLE_ATTR, role)
    return method


def create_colocated_worker_cls(class_dict: Mapping[str, ClassWithInitArgs]) -> ClassWithInitArgs:
    """A ClassWithInitArgs for one worker holding every role; its methods are `<role>_<method>`."""
    if not class_dict:
        raise ValueError("create_colocated_worker_cls: class_dict is empty; pass {role: ClassWithInitArgs(...)}")
    for role, cia in class_dict.items():
        if not isinstance(cia, ClassWithInitArgs):
            raise TypeError(f"create_colocated_worker_cls: role {role!r} maps to {type(cia).__name__}; "
                            "wrap the class as ClassWithInitArgs(cls, *args, **kwargs)")
        if not (isinstance(cia.cls, type) and issubclass(cia.cls, Worker)):
            raise TypeError(f"create_colocated_worker_cls: role {role!r}: {cia.cls!r} is not a Worker subclass")
    roles = dict(class_dict)

    def __init__(self):
        super(colocated, self).__init__()
        self.worker_dict = {role: cia() for role, cia in roles.items()}

    attrs = {"__init__": __init__, "_role_classes": {r: c.cls for r, c in roles.items()},
             "__doc__": f"Colocated roles {list(roles)}."}
    for role, cia in roles.items():
        for name in dir(cia.cls):
            spec = get_method_spec(getattr(cia.cls, name, None))
            if spec is not None:
                attrs[f"{role}_{name}"] = _forward(role, name, spec)
    colocated = type("Colocated_" + "_".join(roles), (Worker,), attrs)
    return ClassWithInitArgs(colocated)
