"""Policy settings: named by the policy's registered name, none ignored without a word."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import _build, registry
from embstore.errors import ConfigError
from embstore.spec import TableSpec, TierSpec
from embstore.tools.simulator import parse_policy


def _spec(**kw):
    return TableSpec("t", dim=4, **kw)


@pytest.mark.parametrize("name", registry.policy_names())
def test_every_policy_is_rebuilt_from_its_config_and_lists_its_settings(name):
    cls = registry.load_policy(name)
    policy = cls.from_options({})
    assert set(policy.config()) <= set(cls.setting_names())  # a manifest's config reopens
    assert cls.from_options(policy.config()).config() == policy.config()
    with pytest.raises(ConfigError, match=f"policy '{name}' takes no setting 'bogus'; "
                                          "its settings: .*seed"):
        cls.from_options({"bogus": 2})


def test_a_policy_spec_with_an_unknown_setting_names_the_policy_not_its_class():
    with pytest.raises(ConfigError) as info:
        parse_policy("lru:bogus=2", "eviction")
    message = str(info.value)
    assert "'lru' takes no setting 'bogus'; its settings: seed" in message
    assert "Eviction" not in message and "__init__" not in message


@pytest.mark.parametrize("admission", [None, "always"])
def test_settings_for_admission_always_are_refused_not_ignored(tmp_path, admission):
    tier = TierSpec("dram", capacity=4, eviction="lru", admission=admission,
                    admission_options={"threshold": 3})
    with pytest.raises(ConfigError, match="'always' takes no setting 'threshold'"):
        embstore.open(tmp_path / "s", tables=[_spec()], tiers=[tier, TierSpec("lmdb")])
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="'always' takes no setting 'threshold'"):
        embstore.open(None, tables=[_spec()], tiers=[tier, TierSpec("dram")])
    # its one setting is taken
    ok = TierSpec("dram", capacity=4, eviction="lru", admission=admission,
                  admission_options={"seed": 3})
    embstore.open(None, tables=[_spec()], tiers=[ok, TierSpec("dram")]).close()


def test_eviction_settings_without_an_eviction_policy_are_refused(tmp_path):
    own = (TierSpec("dram", eviction_options={"ttl": 3}),)
    with embstore.open(tmp_path / "s", tables=[_spec()]) as store:
        store.update("t", np.arange(2), np.ones((2, 4), np.float32))
    # a new table's own chain, added to a store: refused, and the store keeps its one table
    with pytest.raises(ConfigError, match="eviction_options .* no eviction policy"):
        embstore.open(tmp_path / "s", tables=[TableSpec("u", dim=4, tiers=own)])
    with embstore.open(tmp_path / "s") as store:
        assert store.tables == ["t"] and store.num_rows("t") == 2


def test_a_store_made_before_the_check_still_opens(tmp_path, monkeypatch):
    # a manifest holding settings "always" ignores was written by embstore itself: reopening
    # it must not fail on them
    tiers = [TierSpec("dram", capacity=4, eviction="lru", admission="always",
                      admission_options={"threshold": 3}), TierSpec("lmdb")]
    with monkeypatch.context() as m:
        m.setattr(_build, "check_ignored_settings", lambda tiers: None)
        m.setattr(embstore._open, "check_ignored_settings", lambda tiers: None)
        with embstore.open(tmp_path / "s", tables=[_spec()], tiers=tiers) as store:
            store.update("t", np.arange(3), np.ones((3, 4), np.float32))
    with embstore.open(tmp_path / "s") as store:
        np.testing.assert_array_equal(store.lookup("t", np.arange(3)), np.ones((3, 4)))
