"""The interval join's reference: the rules of ``volley_dagster.operators.join`` applied
record by record in plain Python, in log order, one epoch at a time. It shares no code
with the engine: rows wait in a list, each record on time is compared with every
waiting row of the other side, and rows leave when the watermark reaches their bound.

A record is ``(side, key, time, rid)``: side 0 (left) or 1 (right), its event time in
microseconds and an id the test gave it. Each side's watermark trails its own latest
event time; the join's is the lesser of the two, once both have one. The outputs are sets of ``(key, left rid,
right rid)``, None for the missing side of an outer row."""

from __future__ import annotations

from dataclasses import dataclass, field

Row = tuple[int, object, int, object]  # side, key, time, rid
Out = tuple[object, object, object]  # key, left rid, right rid

OUTER = {"inner": (False, False), "left": (True, False), "right": (False, True), "full": (True, True)}


@dataclass
class _Waiting:
    side: int
    key: object
    time: int
    rid: object
    matched: bool = False


@dataclass
class JoinReference:
    lower_us: int
    upper_us: int
    how: str = "inner"
    out_of_orderness_us: int = 0
    watermark: int | None = None
    side_marks: dict[int, int] = field(default_factory=dict)  # each side's own watermark
    waiting: list[_Waiting] = field(default_factory=list)

    def bound(self, row: _Waiting) -> int:
        return row.time + self.upper_us if row.side == 0 else row.time - self.lower_us

    def matches(self, left: _Waiting, right: _Waiting) -> bool:
        return left.key == right.key and self.lower_us <= right.time - left.time <= self.upper_us

    def run(self, records: list[Row]) -> tuple[set[Out], set[Out], list[object]]:
        """One epoch: its records in log order (bad ones left out). Returns the pairs, the
        outer rows, and the late records' rids; advances the watermark."""
        before = self.watermark
        pairs: set[Out] = set()
        late: list[object] = []
        for side, key, time, rid in records:
            if before is not None and time <= before:
                late.append(rid)
                continue
            row = _Waiting(side, key, time, rid)
            for other in self.waiting:
                if other.side == side:
                    continue
                left, right = (row, other) if side == 0 else (other, row)
                if self.matches(left, right):
                    pairs.add((key, left.rid, right.rid))
                    left.matched = right.matched = True
            self.waiting.append(row)
        for side in (0, 1):  # each side's trails its own latest event time; the join's is the lesser
            times = [time for s, _, time, _ in records if s == side]
            if times:
                mark = max(times) - self.out_of_orderness_us
                self.side_marks[side] = max(self.side_marks.get(side, mark), mark)
        if len(self.side_marks) == 2:
            least = min(self.side_marks.values())
            self.watermark = least if before is None else max(before, least)
        outer: set[Out] = set()
        staying: list[_Waiting] = []
        for row in self.waiting:
            if self.watermark is not None and self.bound(row) <= self.watermark:
                if not row.matched and OUTER[self.how][row.side]:
                    outer.add((row.key, row.rid, None) if row.side == 0 else (row.key, None, row.rid))
            else:
                staying.append(row)
        self.waiting = staying
        return pairs, outer, late

    def end_of_stream(self) -> set[Out]:
        """The final epoch: every waiting row leaves, whatever its bound; the outer rows."""
        outer = {(row.key, row.rid, None) if row.side == 0 else (row.key, None, row.rid)
                 for row in self.waiting if not row.matched and OUTER[self.how][row.side]}
        self.waiting = []
        return outer

    def held(self) -> tuple[int, int]:
        """Rows waiting on the left, on the right."""
        return (sum(r.side == 0 for r in self.waiting), sum(r.side == 1 for r in self.waiting))
