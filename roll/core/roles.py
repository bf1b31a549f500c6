"""The roles of a run as a type: each role key of a config names one ``Role`` of one ``RoleKind``.

    Role.parse("actor_train").is_trainer        # True: takes optimizer steps, is checkpointed
    Role.parse("rewards.math").is_reward        # True: scores samples (rule or model)
    Role.parse("rewards.math").reward_name      # "math"
    [name for name in config.roles() if not Role.parse(name).is_reward]   # the model roles

The model roles have fixed names (``MODEL_ROLES``); reward roles are ``rewards.<name>``, one per
entry of the config's ``rewards`` mapping. Code that needs to know what a role does asks its kind
instead of matching the key's text, so the naming rule lives here only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RoleKind(enum.Enum):
    """What a role does in a step."""

    TRAINER = "trainer"  # optimizer steps on the policy or the value model; checkpointed
    INFER = "infer"  # generates the rollouts; receives the trainer's weights
    FORWARD = "forward"  # log-probs of given tokens under fixed weights (the reference model)
    REWARD = "reward"  # scores samples: a rule on CPU or a reward model


# Every model role by its key, in the order configs list them.
MODEL_ROLES: dict[str, RoleKind] = {
    "actor_train": RoleKind.TRAINER,
    "actor_infer": RoleKind.INFER,
    "reference": RoleKind.FORWARD,
    "critic": RoleKind.TRAINER,
}
# A reward role's key is this prefix and its name under the config's ``rewards``.
REWARD_PREFIX = "rewards."
# The roles that train, in config order (the policy first).
TRAINER_ROLES: tuple[str, ...] = tuple(k for k, kind in MODEL_ROLES.items() if kind is RoleKind.TRAINER)


@dataclass(frozen=True)
class Role:
    """One role of a run: its config key (``actor_train``, ``rewards.math``) and its kind."""

    key: str
    kind: RoleKind

    @classmethod
    def parse(cls, key: str) -> Role:
        """The role of a config key; a ValueError names the valid keys for anything else."""
        if key in MODEL_ROLES:
            return cls(key, MODEL_ROLES[key])
        if key.startswith(REWARD_PREFIX) and len(key) > len(REWARD_PREFIX):
            return cls(key, RoleKind.REWARD)
        raise ValueError(
            f"unknown role {key!r}; roles are {', '.join(MODEL_ROLES)} and {REWARD_PREFIX}<name>"
        )

    @classmethod
    def reward(cls, name: str) -> Role:
        """The reward role of ``rewards.<name>``."""
        return cls(f"{REWARD_PREFIX}{name}", RoleKind.REWARD)

    @property
    def is_reward(self) -> bool:
        return self.kind is RoleKind.REWARD

    @property
    def is_trainer(self) -> bool:
        return self.kind is RoleKind.TRAINER

    @property
    def is_model(self) -> bool:
        """Whether the role runs a policy or value model of its own strategy (every non-reward role)."""
        return self.kind is not RoleKind.REWARD

    @property
    def reward_name(self) -> str:
        """``math`` for ``rewards.math``; a ValueError for a model role."""
        if not self.is_reward:
            raise ValueError(f"{self.key!r} is not a reward role")
        return self.key.removeprefix(REWARD_PREFIX)

    def __str__(self) -> str:
        return self.key
