"""Roles as a type: the known keys, the reward prefix, the kinds and what a wrong key says."""

import pytest

from roll.core.roles import MODEL_ROLES, TRAINER_ROLES, Role, RoleKind


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("actor_train", RoleKind.TRAINER),
        ("actor_infer", RoleKind.INFER),
        ("reference", RoleKind.FORWARD),
        ("critic", RoleKind.TRAINER),
        ("rewards.math_rule", RoleKind.REWARD),
    ],
)
def test_parse_gives_the_kind(key, kind):
    role = Role.parse(key)
    assert role.kind is kind and role.key == key and str(role) == key
    assert role.is_reward == (kind is RoleKind.REWARD)
    assert role.is_model == (kind is not RoleKind.REWARD)
    assert role.is_trainer == (key in ("actor_train", "critic"))


def test_reward_role_round_trips_its_name():
    role = Role.reward("math")
    assert role == Role.parse("rewards.math") and role.reward_name == "math"
    with pytest.raises(ValueError, match="not a reward role"):
        _ = Role.parse("critic").reward_name


@pytest.mark.parametrize("key", ["actor", "rewards.", "reward.math", ""])
def test_unknown_keys_list_the_valid_ones(key):
    with pytest.raises(ValueError, match="actor_train, actor_infer, reference, critic and rewards.<name>"):
        Role.parse(key)


def test_trainer_roles_in_config_order():
    assert TRAINER_ROLES == ("actor_train", "critic")
    assert list(MODEL_ROLES) == ["actor_train", "actor_infer", "reference", "critic"]
