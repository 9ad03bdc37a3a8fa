import json

import pytest

from bidirl.config import DataConfig
from bidirl.data import load_gsm8k, load_problems, load_reasoning_gym
from bidirl.errors import BidirlError
from bidirl.reward import numeric_reward
from tests.conftest import SHARED_GSM8K

ADDITION = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False}


def _rows(n):
    return [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2*i}>>{2*i}\n#### {2*i:,}"}
            for i in range(n)]


def test_reasoning_gym_train_and_test_problems_never_overlap():
    train = load_reasoning_gym("basic_arithmetic", ADDITION, 0, "train", 2000)
    test = load_reasoning_gym("basic_arithmetic", ADDITION, 0, "test", 100)
    assert len(test) == 100 and len(train) == 2000
    assert not {p.question for p in train} & {p.question for p in test}


def test_reasoning_gym_problems_are_reproducible_for_a_seed_and_differ_across_seeds():
    first = load_reasoning_gym("basic_arithmetic", ADDITION, 3, "train", 50)
    assert first == load_reasoning_gym("basic_arithmetic", ADDITION, 3, "train", 50)
    assert first != load_reasoning_gym("basic_arithmetic", ADDITION, 4, "train", 50)


def test_reasoning_gym_answers_are_numbers_the_reward_accepts():
    for problem in load_reasoning_gym("gsm_symbolic", {}, 0, "train", 20):
        assert numeric_reward(f"#### {problem.answer}", problem.answer) == 1.0
        assert problem.solution  # gsm_symbolic items carry a worked solution


def test_unknown_task_setting_is_one_clear_error():
    with pytest.raises(BidirlError, match="basic_arithmetic.*max_termz"):
        load_reasoning_gym("basic_arithmetic", {"max_termz": 3}, 0, "train", 5)


def test_local_jsonl_file_loads_through_datasets(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows(5)))
    problems = load_gsm8k(str(path), "train") + load_gsm8k(str(path), "test")
    assert sorted(int(p.answer) for p in problems) == [0, 2, 4, 6, 8]
    assert next(p for p in problems if p.answer == "6").solution.endswith("#### 6")


def test_a_single_file_is_split_so_the_held_out_problems_are_never_trained_on(tmp_path):
    # read whole for both splits, the first training problems were the held-out set (found in review)
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows(200)))
    train, test = load_gsm8k(str(path), "train"), load_gsm8k(str(path), "test")
    assert not {p.question for p in train} & {p.question for p in test}
    assert len(train) + len(test) == 200 and 5 <= len(test) <= 40  # one bucket in ten, by question hash


def test_local_parquet_folder_loads_the_requested_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(_rows(3)).to_parquet(str(tmp_path / "test.parquet"))
    assert [p.answer for p in load_gsm8k(str(tmp_path), "test")] == ["0", "2", "4"]


def test_thousands_separator_in_the_reference_is_normalised(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_rows(600)[-1]))
    assert (load_gsm8k(str(path), "train") + load_gsm8k(str(path), "test"))[0].answer == "1198"


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(BidirlError, match="no_such.jsonl: data file not found"):
        load_gsm8k(str(tmp_path / "no_such.jsonl"), "train")


def test_rows_without_question_or_answer_are_rejected(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x", "answer": "#### 1"}))
    with pytest.raises(BidirlError, match="row 0 lacks"):
        load_gsm8k(str(path), "train")


def test_corrupt_data_file_is_one_clear_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(BidirlError, match="broken.parquet: cannot read as parquet"):
        load_gsm8k(str(path), "train")


def test_load_problems_caps_the_split_sizes():
    cfg = DataConfig(task="basic_arithmetic", task_config=ADDITION, train_size=30, eval_size=7)
    assert len(load_problems(cfg, "train")) == 30 and len(load_problems(cfg, "test")) == 7


@pytest.mark.skipif(not SHARED_GSM8K.is_dir(), reason="real GSM8K files are in ../shared only")
def test_every_real_gsm8k_reference_parses_and_its_own_solution_scores_one():
    problems = load_gsm8k(str(SHARED_GSM8K), "train") + load_gsm8k(str(SHARED_GSM8K), "test")
    assert len(problems) == 8792
    for problem in problems:
        assert numeric_reward(problem.solution, problem.answer) == 1.0, problem.solution[-80:]


def test_few_shot_examples_reach_the_training_prompts_not_only_the_evaluate_stage():
    from bidirl.config import load_config
    from bidirl.prompts import PromptBuilder
    from bidirl.runtime.batches import RolloutData
    from bidirl.sched.cluster import Chunk

    cfg = load_config(None, ["data.few_shot=2", "data.prompt_style=compact", "data.train_size=50",
                             "data.eval_size=10", "rollout.group_size=2"])
    prompt = PromptBuilder.for_run(cfg.data)  # the one builder of the run: training and both evaluations
    request = RolloutData(cfg, prompt).request(Chunk(index=0, device=0, first=0, groups=3, version=0))
    first, second = prompt.shots
    assert len(request.prompts) == 3
    assert all(p.startswith(f"{first.question} = {first.answer}\n{second.question} = {second.answer}\n")
               for p in request.prompts)


def test_an_addition_chain_gets_its_worked_steps_whose_last_result_is_the_reward_winning_answer():
    from bidirl.data import worked_chain
    from bidirl.prompts import target_completion

    assert worked_chain("4 - 1 - 7") == "4-1=3, 3-7=-4"
    assert worked_chain("(1 + 2) * 3") == worked_chain("12") == ""  # nothing a chain of steps can show
    problems = load_reasoning_gym("basic_arithmetic", {"min_terms": 2, "max_terms": 12, "min_digits": 1,
                                                        "max_digits": 1, "operators": ["+", "-"],
                                                        "allow_parentheses": False, "allow_negation": False},
                                  0, "train", 50)
    for problem in problems:
        worked = target_completion(problem, "worked")
        assert worked.startswith(f" {problem.solution} #### ") and numeric_reward(worked, problem.answer) == 1.0
        assert worked.split(" #### ")[0].split("=")[-1] == problem.answer  # the steps end at the answer
        assert target_completion(problem) == f" {problem.answer}"
    lengths = [len(target_completion(p, "worked")) for p in problems]
    assert max(lengths) >= 5 * min(lengths)  # longer chains, longer responses


def test_a_worked_tiny_recipe_gets_its_own_cached_base_model():
    from bidirl.config import load_config
    from bidirl.models.base import tiny_cache_dir

    default = load_config("pipelines/cpu-tiny.yaml", [])
    worked = load_config("pipelines/cpu-tiny.yaml", ["model.tiny.sft_target=worked"])
    assert tiny_cache_dir(worked) != tiny_cache_dir(default)


def test_a_drawn_problem_list_is_kept_and_read_back_unchanged_without_drawing_again(tmp_path, monkeypatch):
    import bidirl.data

    cfg = DataConfig(task="basic_arithmetic", task_config=ADDITION, train_size=300, eval_size=40,
                     cache_dir=str(tmp_path / "problems"))
    drawn = load_problems(cfg, "train")
    assert drawn == load_reasoning_gym("basic_arithmetic", ADDITION, 0, "train", 300)
    monkeypatch.setattr(bidirl.data, "load_reasoning_gym", lambda *a: pytest.fail("drawn again"))
    assert load_problems(cfg, "train") == drawn
    # anything that decides the list is in its key: another seed or split is drawn, not read
    for other in (DataConfig(**{**cfg.__dict__, "seed": 1}), cfg):
        with pytest.raises(pytest.fail.Exception, match="drawn again"):
            load_problems(other, "test" if other is cfg else "train")


def test_an_unreadable_cached_list_is_drawn_again(tmp_path):
    cfg = DataConfig(task="basic_arithmetic", task_config=ADDITION, train_size=50, cache_dir=str(tmp_path))
    drawn = load_problems(cfg, "train")
    (cached,) = tmp_path.glob("*.json")
    cached.write_text("{not json")
    assert load_problems(cfg, "train") == drawn
    assert json.loads(cached.read_text())[0][0] == drawn[0].question  # and kept again
