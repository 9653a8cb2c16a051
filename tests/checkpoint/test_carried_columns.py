"""Review J3: the columns a join's waiting rows carry are recorded by type; a type the
waiting rows cannot be read as is refused by name when the epoch's identity is checked,
before anything runs, as a permanent error. A column may come or go, and an integer may
widen; a root recorded before the record existed is not refused. No Spark."""

from __future__ import annotations

import pytest

from volley_dagster.checkpoint.carried import CARRIED_COLUMNS, readable_as
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.errors import StateLayoutError, is_retryable

JOIN = {"join": {"left": "payments", "right": "refunds", "on": "payment_id"}}


def identity(payments: dict[str, str] | None) -> dict[str, object]:
    operator = dict(JOIN) if payments is None else {**JOIN, CARRIED_COLUMNS: {"payments": payments, "refunds": {}}}
    return {"pipeline": "refunds", "layout": {"num_shards": 2}, "aggregate": operator}


def test_a_carried_columns_type_change_is_refused_by_name_and_never_retried(tmp_path):
    log = EpochLog(tmp_path / "root")
    log.root.mkdir()
    log.check_identity(identity({"amount": "bigint", "paid_at": "timestamp"}))
    log.check_identity(identity({"amount": "bigint", "paid_at": "timestamp"}))
    log.check_identity(identity({"amount": "bigint", "paid_at": "timestamp", "note": "string"}))  # added: null in old rows
    log.check_identity(identity({"paid_at": "timestamp"}))  # no longer carried: ignored in old rows
    with pytest.raises(StateLayoutError, match=r"column 'amount' of 'payments' was carried as bigint and is now "
                                               r"double.*nothing was run") as refused:
        log.check_identity(identity({"amount": "double", "paid_at": "timestamp"}))
    assert not is_retryable(refused.value)
    with pytest.raises(StateLayoutError, match="'amount' of 'payments' was carried as bigint and is now string"):
        log.check_identity(identity({"amount": "string", "paid_at": "timestamp"}))


def test_a_root_recorded_before_the_carried_columns_were_is_not_refused(tmp_path):
    log = EpochLog(tmp_path / "root")
    log.root.mkdir()
    log.check_identity(identity(None))
    log.check_identity(identity({"amount": "double"}))


def test_integers_widen_and_nothing_else_changes():
    assert readable_as("int", "bigint") and readable_as("tinyint", "int") and readable_as("string", "string")
    assert not readable_as("bigint", "int") and not readable_as("bigint", "double") and not readable_as("date", "string")
