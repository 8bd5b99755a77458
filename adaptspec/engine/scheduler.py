"""Continuous batching: a FIFO waiting queue and a fixed set of KV slots."""
from __future__ import annotations

from collections import deque

from adaptspec.engine.sequence import Sequence, Status


class Scheduler:
    """Requests join (between steps) while a KV slot is free; they leave when finished."""

    def __init__(self, num_slots: int, max_model_len: int):
        self.max_model_len = max_model_len
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept sorted by slot: contiguous slots avoid a gather

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def can_allocate(self) -> bool:
        return bool(self.free_slots)

    def allocate(self, seq: Sequence) -> None:
        seq.slot = self.free_slots.pop()
        seq.status = Status.RUNNING
        self.running.append(seq)

    def free(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            self.free_slots.sort(reverse=True)
            seq.slot = -1
        if seq in self.running:
            self.running.remove(seq)

    def schedule(self) -> list[Sequence]:
        """Admit waiting requests into free slots; return the newly admitted ones."""
        admitted = []
        while self.waiting and self.can_allocate():
            seq = self.waiting.popleft()
            self.allocate(seq)
            admitted.append(seq)
        if admitted:
            self.running.sort(key=lambda s: s.slot)
        return admitted

    def remove_waiting(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
            return True
        except ValueError:
            return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
