"""BlockManager: global KV block accounting, append/free, resize for Rebind, and its invariants under random use."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.router.block_manager import BlockManager, num_blocks_for
from services.router.sequence import Sequence


def _seq(request_id: str, num_prompt_tokens: int) -> Sequence:
    return Sequence(request_id, list(range(num_prompt_tokens)), max_tokens=8)


def test_allocate_covers_the_step_and_counts_add_up():
    manager = BlockManager(num_blocks=10, block_size=4)
    seq = _seq("a", 9)
    manager.allocate(seq)  # all 9 uncomputed tokens -> 3 blocks
    assert seq.block_ids == [0, 1, 2]
    assert (manager.num_used, manager.num_free, manager.num_total) == (3, 7, 10)
    assert manager.usage == pytest.approx(0.3)
    assert all(manager.owner(b) == "a" for b in seq.block_ids) and manager.owner(3) is None


def test_allocate_a_chunk_then_append_to_the_block_boundary():
    manager = BlockManager(num_blocks=10, block_size=4)
    seq = _seq("a", 10)
    manager.allocate(seq, num_new_tokens=4)
    assert seq.block_ids == [0]
    seq.num_computed_tokens = 4
    assert manager.append_slots(seq, 4) and seq.block_ids == [0, 1]  # tokens 4..7 fill block 1 exactly
    seq.num_computed_tokens = 8
    assert manager.num_blocks_needed(seq, 0) == 0
    assert manager.append_slots(seq, 2) and len(seq.block_ids) == 3
    seq.num_computed_tokens = 10
    assert manager.append_slots(seq, 1) and len(seq.block_ids) == 3  # slot 10 still in block 2


def test_append_slots_is_all_or_nothing():
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = _seq("a", 4), _seq("b", 4)
    manager.allocate(a)
    a.num_computed_tokens = 4
    manager.allocate(b, 1)
    assert not manager.append_slots(a, 4)  # needs 2 more blocks, 1 free: refused, nothing taken
    assert a.block_ids == [0, 1] and (manager.num_used, manager.num_free) == (3, 1)
    assert manager.append_slots(a, 2) and a.block_ids == [0, 1, 3] and manager.num_free == 0
    with pytest.raises(RuntimeError):
        manager.allocate(_seq("c", 1))
    with pytest.raises(ValueError):
        manager.allocate(a)  # already holds blocks


def test_free_returns_blocks_and_lowest_ids_are_reused_first():
    manager = BlockManager(num_blocks=6, block_size=2)
    a, b = _seq("a", 4), _seq("b", 4)
    manager.allocate(a)
    manager.allocate(b)
    manager.free(a)
    assert a.block_ids == [] and manager.num_free == 4
    c = _seq("c", 6)
    manager.allocate(c)
    assert c.block_ids == [0, 1, 4]
    with pytest.raises(RuntimeError):
        manager.free(Sequence("x", [1], 1, block_ids=[2]))  # block 2 belongs to b


def test_truncate_returns_only_the_blocks_past_the_kept_tokens():
    manager = BlockManager(num_blocks=6, block_size=4)
    seq = _seq("a", 13)
    manager.allocate(seq)  # a failed step fed all 13 tokens; 5 of them were cached before it
    manager.truncate(seq, 5)
    assert seq.block_ids == [0, 1] and manager.num_used == 2
    manager.truncate(seq, 8)  # nothing past 8 tokens: no change
    assert seq.block_ids == [0, 1]
    manager.truncate(seq, 0)
    assert seq.block_ids == [] and manager.num_free == 6


def test_resize_grows_and_shrinks_when_the_tail_is_free():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = _seq("a", 4)
    manager.allocate(a)
    assert manager.resize(8) == [] and (manager.num_total, manager.num_free) == (8, 6)
    assert manager.resize(2) == [] and (manager.num_total, manager.num_free, manager.num_used) == (2, 0, 2)
    assert not manager.can_allocate(1)
    assert manager.resize(5) == [] and manager.num_free == 3


def test_resize_reports_used_ids_that_block_a_shrink_and_changes_nothing():
    manager = BlockManager(num_blocks=6, block_size=1)
    a, b = _seq("a", 3), _seq("b", 3)
    manager.allocate(a)
    manager.allocate(b)  # b holds 3, 4, 5
    assert manager.resize(4) == [4, 5]
    assert (manager.num_total, manager.num_used, manager.num_free) == (6, 6, 0)
    manager.free(b)
    assert manager.resize(4) == [] and manager.num_free == 1
    c = _seq("c", 1)
    manager.allocate(c)
    assert c.block_ids == [3]
    with pytest.raises(ValueError):
        manager.resize(0)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / step / free / resize; every invariant of the accounting holds after each operation."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.integers(1, 5))
    def setup(self, num_blocks, block_size):
        self.manager = BlockManager(num_blocks, block_size)
        self.sequences: dict[str, Sequence] = {}
        self.counter = 0

    @rule(num_prompt_tokens=st.integers(1, 30), chunk=st.integers(1, 30))
    def allocate(self, num_prompt_tokens, chunk):
        seq = _seq(f"s{self.counter}", num_prompt_tokens)
        self.counter += 1
        chunk = min(chunk, num_prompt_tokens)
        needed = self.manager.num_blocks_needed(seq, chunk)
        if self.manager.can_allocate(needed):
            self.manager.allocate(seq, chunk)
            seq.num_computed_tokens = chunk  # the step ran
            self.sequences[seq.request_id] = seq
        else:
            with pytest.raises(RuntimeError):
                self.manager.allocate(seq, chunk)
            assert seq.block_ids == []

    @precondition(lambda self: self.sequences)
    @rule(data=st.data(), num_new_tokens=st.integers(0, 9))
    def step(self, data, num_new_tokens):
        seq = self.sequences[data.draw(st.sampled_from(sorted(self.sequences)))]
        before, free_before = list(seq.block_ids), self.manager.num_free
        if self.manager.append_slots(seq, num_new_tokens):
            seq.num_computed_tokens += num_new_tokens
            assert seq.block_ids[:len(before)] == before
        else:
            assert seq.block_ids == before and self.manager.num_free == free_before

    @precondition(lambda self: self.sequences)
    @rule(data=st.data())
    def free(self, data):
        seq = self.sequences.pop(data.draw(st.sampled_from(sorted(self.sequences))))
        self.manager.free(seq)

    @rule(num_blocks=st.integers(1, 32))
    def resize(self, num_blocks):
        total_before = self.manager.num_total
        blocking = self.manager.resize(num_blocks)
        used = {b for s in self.sequences.values() for b in s.block_ids}
        assert blocking == sorted(b for b in used if b >= num_blocks)
        assert self.manager.num_total == (total_before if blocking else num_blocks)

    @invariant()
    def accounting_holds(self):
        manager = self.manager
        owned = [b for s in self.sequences.values() for b in s.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned by two sequences"
        assert manager.num_used == len(owned)
        assert manager.num_free + manager.num_used == manager.num_total
        assert all(0 <= b < manager.num_total for b in owned)
        for seq in self.sequences.values():
            assert len(seq.block_ids) == num_blocks_for(seq.num_computed_tokens, manager.block_size)
            assert all(manager.owner(b) == seq.request_id for b in seq.block_ids)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
