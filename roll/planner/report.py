"""The memory plan of a run: per device, the roles sharing it, each role's predicted peak and the
device's peak over the stages; a warning per device that will not fit.

    report = memory_report(config, plan_placement(config))   # ConfigError with memory_check: error
    print(report.format())

Colocated roles time-share a device: while one runs, the others keep only what their offload
settings leave there (``RoleMemory.idle``), so a device's peak is the largest, over its roles, of
that role's peak plus the others' idle memory -- not the sum of the peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.device_mapping import format_device_ids
from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.core.roles import Role
from roll.distributed.scheduler.placement import PlacementPlan
from roll.planner.devices import device_capacity
from roll.planner.model_shape import ModelShape, load_model_shape
from roll.planner.roles import GIB, RoleMemory, role_memory

PARTS = ("params", "grads", "optimizer", "activations", "logits", "kv_cache", "engine", "buffers")
HEADERS = ("params", "grads", "optim", "activ", "logits", "kv", "engine", "buffers")


@dataclass(frozen=True)
class DeviceGroup:
    """Devices that hold the same roles."""

    devices: tuple[int, ...]
    roles: tuple[RoleMemory, ...]

    def stage_peaks(self) -> dict[str, int]:
        """Per role: resident bytes while that role runs (its peak + the others' idle memory)."""
        return {
            r.role: r.peak + sum(o.idle + o.context for o in self.roles if o is not r) for r in self.roles
        }

    def peak(self) -> tuple[str, int]:
        stages = self.stage_peaks()
        role = max(stages, key=stages.__getitem__)
        return role, stages[role]


@dataclass
class MemoryReport:
    groups: list[DeviceGroup]
    capacity: int | None
    source: str
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def format(self) -> str:
        lines = [f"Memory plan (GiB per device, one rank of each role; device memory: {self.source})"]
        if self.groups:
            head = "".join(f"{h:>8}" for h in HEADERS)
            lines.append(f"{'devices':<10}{'role':<20}{'strategy':<16}{head}{'ctx':>6}{'peak':>8}{'idle':>7}")
        for group in self.groups:
            ids = format_device_ids(list(group.devices))
            for i, r in enumerate(group.roles):
                cells = "".join(f"{_gib(r.parts.get(p, 0)):>8}" for p in PARTS)
                idle = r.idle + r.context if len(group.roles) > 1 else 0
                lines.append(
                    f"{ids if i == 0 else '':<10}{r.role:<20}{r.strategy:<16}{cells}"
                    f"{_gib(r.context):>6}{_gib(r.peak):>8}{_gib(idle):>7}"
                )
            role, peak = group.peak()
            fit = "" if self.capacity is None else f" of {self.capacity / GIB:.1f}"
            lines.append(f"{'':<10}device peak {peak / GIB:.1f}{fit} GiB, while {role} runs")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}" if value else "-"


def plan_memory(
    config: RLVRConfig, plan: PlacementPlan, capacity: int | None, source: str = ""
) -> MemoryReport:
    """Predict every device-holding role and group the devices; warnings for groups over ``capacity``."""
    report = MemoryReport([], capacity, source)
    colocated = {n for owners, _ in plan.shared for n in owners if not Role.parse(n).is_reward}
    shapes: dict[str, ModelShape] = {}
    roles: dict[str, RoleMemory] = {}
    for name, role in config.roles().items():
        rp = plan.roles[name]
        if rp.cpu_only or not role.model_args.model_name_or_path:
            continue
        path = role.model_args.model_name_or_path
        try:
            if path not in shapes:
                shapes[path] = load_model_shape(path, f"{name}.model_args.model_name_or_path")
            roles[name] = role_memory(name, role, config, rp, shapes[path], capacity, name in colocated)
        except (ConfigError, KeyError) as exc:
            report.notes.append(f"{name}: not predicted ({exc})")
    by_roles: dict[tuple[str, ...], list[int]] = {}
    for device in sorted({d for rp in plan.roles.values() for d in rp.devices}):
        owners = tuple(n for n in roles if device in plan.roles[n].devices)
        if owners:
            by_roles.setdefault(owners, []).append(device)
    for owners, devices in by_roles.items():
        report.groups.append(DeviceGroup(tuple(devices), tuple(roles[n] for n in owners)))
    if capacity is not None:
        report.warnings = [w for g in report.groups if (w := overflow_warning(g, capacity, source))]
    return report


def overflow_warning(group: DeviceGroup, capacity: int, source: str) -> str | None:
    """One line naming the devices, the stage, the overflow, the largest term (a part of
    ``PARTS`` of the running role, or another role's idle memory) and the key to turn."""
    role_name, peak = group.peak()
    if peak <= capacity:
        return None
    running = next(r for r in group.roles if r.role == role_name)
    candidates = [(running.parts[p], running.role, p, running.knob_for(p)) for p in running.parts]
    candidates += [
        (o.idle, o.role, "idle", o.knob_for("idle")) for o in group.roles if o is not running and o.idle
    ]
    size, who, part, knob = max(candidates)
    others = ", ".join(f"{o.role} {(o.idle + o.context) / GIB:.1f}" for o in group.roles if o is not running)
    resident = f" + resident {others}" if others else ""
    return (
        f"devices {format_device_ids(list(group.devices))}: predicted peak {peak / GIB:.1f} GiB while "
        f"{role_name} runs ({running.peak / GIB:.1f}{resident}) exceeds {capacity / GIB:.1f} GiB "
        f"({source}) by {(peak - capacity) / GIB:.1f} GiB; largest: {who} {part} {size / GIB:.1f} GiB "
        f"({100 * size / peak:.0f}% of the peak) -> turn {knob}"
    )


# ``memory_check``: what a device predicted not to fit does.
MEMORY_CHECKS = ("warn", "error", "off")


def memory_report(config: RLVRConfig, plan: PlacementPlan) -> MemoryReport:
    """The plan for ``--dry_run`` and launch; with ``memory_check: error`` an overflow is a ConfigError."""
    if config.device == "cpu" or config.memory_check == "off":
        why = "device: cpu (host RAM is not checked)" if config.device == "cpu" else "memory_check: off"
        return MemoryReport([], None, why, notes=[f"no memory plan: {why}"])
    capacity, source = device_capacity(config)
    report = plan_memory(config, plan, capacity, source)
    if report.warnings and config.memory_check == "error":
        raise ConfigError("memory_check", f"{report.warnings[0]} (memory_check: warn only warns)")
    return report
