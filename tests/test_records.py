import pytest

from memopd.records import Episode, Invocation, RecordError, Retained, load_episodes, save_episodes


def _episode():
    q = [1, 2, 3]
    a0 = [10, 11, 12]
    return Episode(
        task_id="t0", prefix_len=3, reward=0.5, metrics={"f1": 0.5, "calls": 2},
        invocations=[
            Invocation(q + [4, 5], a0, logprobs=[-0.1, -0.2, -0.3], stop_reason="stop"),
            Invocation(q + [11, 12, 6], [13], stop_reason="eos", retained=[Retained(0, 1, 3, 2)]),
        ],
    )


def test_round_trip_is_lossless(tmp_path):
    eps = [_episode(), Episode("t1", 0, [Invocation([7], [8, 9])])]
    save_episodes(tmp_path / "e.parquet", eps)
    back = load_episodes(tmp_path / "e.parquet")
    assert back == eps
    assert back[0].invocations[0].logprobs == [-0.1, -0.2, -0.3]  # float64: exact
    assert back[0].invocations[1].logprobs is None
    assert not list(tmp_path.glob("*.tmp"))


def test_large_token_ids_survive(tmp_path):
    ep = Episode("big", 1, [Invocation([151_935, 151_643], [151_644])])
    save_episodes(tmp_path / "e.parquet", [ep])
    assert load_episodes(tmp_path / "e.parquet") == [ep]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda e: e.invocations[1].input_ids.__setitem__(0, 99), "shared prefix"),
        (lambda e: e.invocations[1].retained.__setitem__(0, Retained(0, 0, 3, 2)), "does not hold"),
        (lambda e: e.invocations[1].retained.__setitem__(0, Retained(1, 0, 3, 1)), "must be earlier"),
        (lambda e: e.invocations[1].retained.__setitem__(0, Retained(0, 2, 3, 2)), "outside call 0"),
        (lambda e: e.invocations[0].logprobs.pop(), "log-probs"),
        (lambda e: e.invocations[1].output_ids.clear(), "empty sampled response"),
    ],
)
def test_validation_names_the_problem(mutate, message):
    ep = _episode()
    mutate(ep)
    with pytest.raises(RecordError, match=message):
        ep.validate()


def test_loading_a_foreign_parquet_fails_clearly(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), tmp_path / "x.parquet")
    with pytest.raises(RecordError, match="missing columns"):
        load_episodes(tmp_path / "x.parquet")
