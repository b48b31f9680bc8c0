"""Where `serve --replicas` puts its workers: per NUMA node on a machine with several (a fake
topology here: these machines have one), nowhere in particular on a machine with one."""

from __future__ import annotations

from pathlib import Path

from hybridkv.server.replicas import numa_nodes, parse_cpulist, placement, split

TWO_NODES = [list(range(0, 8)), list(range(8, 16))]


def test_replicas_go_round_the_nodes_and_split_each_nodes_cpus() -> None:
    assert placement(2, TWO_NODES) == [(0, list(range(8))), (1, list(range(8, 16)))]
    assert placement(4, TWO_NODES) == [(0, [0, 1, 2, 3]), (1, [8, 9, 10, 11]), (0, [4, 5, 6, 7]), (1, [12, 13, 14, 15])]
    three = placement(3, TWO_NODES)
    assert three[0] == (0, [0, 1, 2, 3]) and three[1] == (1, list(range(8, 16))) and three[2] == (0, [4, 5, 6, 7])


def test_more_replicas_than_cpus_share_the_node() -> None:
    assert placement(4, [[0], [1]]) == [(0, [0]), (1, [1]), (0, [0]), (1, [1])]


def test_one_node_pins_nothing() -> None:
    assert placement(3, [list(range(16))]) == [None, None, None]
    assert placement(2, []) == [None, None]


def test_nodes_are_read_from_sysfs(tmp_path: Path) -> None:
    import os

    allowed = sorted(os.sched_getaffinity(0))
    for node, cpus in enumerate((allowed[:1], allowed[1:])):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
    assert numa_nodes(tmp_path) == [c for c in (allowed[:1], allowed[1:]) if c]


def test_cpulists_and_splits() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert split(5, 2) == [3, 2] and split(2, 2) == [1, 1] and sum(split(7, 3)) == 7
