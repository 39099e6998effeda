"""Undoable patch steps: the undo stack and hooks queued behind a switch."""

from __future__ import annotations

import enum

import pytest

from sglang_xpu_lora.patches import undo as undo_module
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook


class FakeHookRegistry:
    registered: list = []

    @classmethod
    def register(cls, target, hook, hook_type):
        cls.registered.append((target, hook, hook_type))


HookType = enum.Enum("HookType", "BEFORE AFTER AROUND REPLACE")


@pytest.fixture
def hooks(monkeypatch):
    FakeHookRegistry.registered = []
    monkeypatch.setattr(undo_module, "resolve", lambda target: FakeHookRegistry if target.endswith("HookRegistry") else HookType)
    return FakeHookRegistry.registered


def test_unwind_undoes_newest_first_and_reports_a_failing_undo():
    done, stack = [], UndoStack()
    stack.push("first", lambda: done.append(1))
    stack.push("broken", lambda: 1 / 0)
    stack.push("last", lambda: done.append(3))
    assert stack.unwind() == ["undid last", "could not undo broken (ZeroDivisionError: division by zero)", "undid first"]
    assert done == [3, 1] and stack.unwind() == []


def test_each_hook_type_passes_through_once_undone(hooks):
    stack = UndoStack()
    queue_hook("m.f", lambda original, x: original(x) * 10, "AROUND", stack)
    queue_hook("m.g", lambda result, x: result + x, "AFTER", stack)
    queue_hook("m.h", lambda x: ((x + 1,), {}), "BEFORE", stack)
    (_, around, t1), (_, after, t2), (_, before, t3) = hooks
    assert (t1, t2, t3) == (HookType.AROUND, HookType.AFTER, HookType.BEFORE)
    assert (around(lambda x: x + 1, 1), after(5, 2), before(1)) == (20, 7, ((2,), {}))
    stack.unwind()
    assert (around(lambda x: x + 1, 1), after(5, 2), before(1)) == (2, 5, None)


def test_replace_hooks_are_refused(hooks):
    with pytest.raises(ValueError, match="not REPLACE"):
        queue_hook("m.f", lambda: None, "REPLACE", UndoStack())
    assert hooks == []
