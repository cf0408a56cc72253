"""The sandbox's uid pool never holds a uid someone has: a finished call kills every process of its uid, so a pool
starting at root's uid (0) or holding a host user's uid would kill that user's processes."""

from __future__ import annotations

import pwd

import pytest

from arpo_base.errors import ConfigError
from arpo_env.tools.python_tool import PythonTool
from arpo_env.tools.sandbox import POOL_SIZE, check_uid_base


@pytest.mark.parametrize("value", [0, 1000, -5, 2**31])
def test_a_uid_base_below_the_pool_floor_or_out_of_range_is_refused(value):
    with pytest.raises(ConfigError, match="outside"):
        PythonTool(backend="subprocess", uid_base=value, allow_unisolated_python=True)


@pytest.mark.parametrize("value", ["62000", 62000.0, True])
def test_a_uid_base_that_is_not_an_integer_is_refused(value):
    with pytest.raises(ConfigError, match="must be an integer uid"):
        check_uid_base(value)


def test_a_pool_holding_a_host_users_uid_is_refused_naming_the_user():
    user = max((u for u in pwd.getpwall() if u.pw_uid >= 10_000 + POOL_SIZE), key=lambda u: u.pw_uid, default=None)
    if user is None:  # every Debian host has nobody (65534); a host without any such user has nothing to protect
        pytest.fail("no user with a uid above the pool floor in the user database")
    with pytest.raises(ConfigError, match=f"uid {user.pw_uid} .{user.pw_name}.") as err:
        check_uid_base(user.pw_uid - 10)
    assert "no user has" in err.value.hint
    assert check_uid_base(62_000) == 62_000  # the default pool is free
