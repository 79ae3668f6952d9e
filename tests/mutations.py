"""The planted bugs of `tools/mutate.py`: each names a file, an exact snippet, its replacement and the narrow
tests that must fail with it (docs/TESTING.md "Mutation table"). They live beside the tests because they describe
what the suite must catch; `tests/test_harness.py` checks that every snippet still occurs exactly once, so a
mutation cannot go stale unnoticed between runs of the (slow) mutation runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    behaviour: str  # what the tests must protect, in a few words
    file: str
    edits: tuple[tuple[str, str], ...]  # (original snippet, replacement), applied in order
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository root
    timeout: int = 300


def m(name: str, behaviour: str, file: str, original: str, replacement: str, *tests: str, timeout: int = 300,
      more: tuple[tuple[str, str], ...] = ()) -> Mutation:
    return Mutation(name, behaviour, file, ((original, replacement), *more), tests, timeout)


MUTATIONS = [
    # letter ids (docs/PROTOCOL.md §4.6)
    m("letters-bare", "letter ids come from the prompt with the prefill, not the bare letter",
      "basal_local/model/tokenizer.py", "            ids.append(extended[-1])",
      "            ids.append(self.encode(letter)[-1])", "tests/test_letter_ids.py"),
    m("letters-shift", "letter ids are not shifted by one",
      "basal_local/model/tokenizer.py", "            ids.append(extended[-1])", "            ids.append(extended[-1] + 1)",
      "tests/test_letter_ids.py"),
    m("letters-sorted", "letter ids keep letter order (not sorted by id)",
      "basal_local/model/tokenizer.py", "            ids.append(extended[-1])\n",
      "            ids.append(extended[-1])\n            ids.sort()\n", "tests/test_letter_ids.py"),
    m("plan-letters-offset", "a question with k options reads the first k letter ids",
      "basal_local/engine/plan.py", "tokenizer.letter_ids[: len(perms[0])]", "tokenizer.letter_ids[-len(perms[0]):]",
      "tests/test_letter_ids.py"),
    # tokenization and rendering, seen end to end against the independent reference
    m("tokenize-prepend-always", "Metaspace runs with prepend_scheme first (§4.6)",
      "basal_local/model/tokenizer.py", 'fixed["pre_tokenizer"] = {**pre, "prepend_scheme": "first"}',
      'fixed["pre_tokenizer"] = {**pre, "prepend_scheme": "always"}',
      "tests/test_e2e.py::test_every_type_matches_independent_computation", timeout=600),
    m("render-opts-separator", "option lines are joined by one LF (§4.5), seen end to end",
      "basal_local/protocol/render.py", '"\\n".join(', '"\\n\\n".join(',
      "tests/test_e2e.py::test_every_type_matches_independent_computation", timeout=600),
    m("tree-readouts", "`prompts --tree` shows which prompt reads out where",
      "basal_local/engine/pretty.py", 'owners = f"  -> prompts {block.readouts}"',
      'owners = f"  -> prompts {[0 for _ in block.readouts]}"', "tests/test_e2e.py::test_prompts_cli_round_trip"),
    # decision math and the upstream dialect (docs/PROTOCOL.md §5, §8)
    m("unknown-type-calibrated", "an unknown /v1/basal type is choice with no calibration",
      "basal_local/api/basal.py",
      'calibration_key = qtype if raw_type in ("choice", "noul", "score") else None', "calibration_key = qtype",
      "tests/test_api_errors.py::test_basal_lenient_unknown_type_is_uncalibrated_choice"),
    m("calibrate-floor", "calibration floors p at 1e-12",
      "basal_local/protocol/decision.py", "math.log(max(v, PROB_FLOOR))", "math.log(max(v, 1e-6))",
      "tests/test_decision.py"),
    m("orders-not-unpermuted", "the second order is un-permuted before averaging",
      "basal_local/protocol/decision.py", "acc[option] += q[position]", "acc[position] += q[position]",
      "tests/test_decision.py"),
    # scheduling (docs/ARCHITECTURE.md "Scheduling")
    m("long-lane-batches", "the long lane runs one request at a time",
      "basal_local/engine/lane.py", "budget = settings.max_batch_tokens if self.urgent else 0",
      "budget = settings.max_batch_tokens", "tests/test_scheduler.py::test_long_lane_runs_one_request_at_a_time"),
    m("growth-not-shared", "batch forming counts shared prefixes once against max_batch_tokens",
      "basal_local/engine/scheduler.py", "        if trial.tokens <= max_batch_tokens:",
      "        if sizer.tokens + job.tokens <= max_batch_tokens:", "tests/test_queue_order.py"),
    m("hrrn-is-sjf", "HRRN ages: a long job is served behind a stream of short ones",
      "basal_local/engine/scheduler.py", "key=lambda j: (j.background, -response_ratio(j, now, rate, overhead_s))",
      "key=lambda j: (j.background, j.tokens)", "tests/test_queue_order.py"),
    m("hrrn-rate-blind", "the measured rate changes the HRRN order",
      "basal_local/engine/scheduler.py", "return overhead_s + max(tokens, 1) / rate", "return max(tokens, 1) / rate",
      "tests/test_queue_order.py"),
    m("cancelled-computed", "a cancelled request costs no forward",
      "basal_local/engine/lane.py", "                if job.gone():", "                if False:",
      "tests/test_scheduler.py::test_cancelled_requests_cost_no_forward"),
    # engine lifecycle: no job can hurt another job or a lane
    m("cancelled-future-set", "a future the waiter cancelled is left alone (its batch-mates are answered)",
      "basal_local/engine/scheduler.py", "        except InvalidStateError:\n            pass\n\n    def fail",
      "        except InvalidStateError:\n            raise\n\n    def fail",
      "tests/test_engine_lifecycle.py::test_a_job_cancelled_during_compute_does_not_fail_its_batch_mates"),
    m("stop-leaves-queue", "stop() fails the queued jobs at once",
      "basal_local/engine/lane.py", "        for job in queued:\n            job.fail(EngineStopped())",
      "        for job in queued:\n            pass",
      "tests/test_engine_lifecycle.py::test_stop_fails_queued_jobs_finishes_the_running_batch_and_joins_the_threads"),
    m("dead-replica-kept", "a replica whose device died leaves the rotation and its requests run elsewhere",
      "basal_local/replicas/inprocess.py", "            self.dead.add(engine.replica)", "            pass",
      "tests/test_replicas.py::test_a_dead_replica_leaves_the_rotation_and_nothing_is_lost"),
    # tree attention: the tile plan against the dense visibility rule
    m("plan-short-range", "a tile's key ranges cover each ancestor block and its own block whole",
      "cuda_kernels/plan.py", "rec += (first_pos[c], starts[c], ends[c] - starts[c])",
      "rec += (first_pos[c], starts[c], ends[c] - starts[c] - 1)",
      "tests/test_tree_attention.py::test_tile_plan_visibility_is_the_dense_rule"),
    m("twin-sees-own-key-late", "the attention twin lets a query see the key at its own position",
      "cuda_kernels/twins.py", "mask = key_rows[0][None, :] <= positions[rows].long()[:, None]",
      "mask = key_rows[0][None, :] < positions[rows].long()[:, None]",
      "tests/test_cuda_kernels.py::test_tile_table_twin_equals_dense_mask"),
    # packing
    m("packer-positions", "packed positions are each token's index in its own prompt",
      "basal_local/engine/packer.py", "positions.extend(range(block.start, block.start + len(block.tokens)))",
      "positions.extend(range(block.start + 1, block.start + 1 + len(block.tokens)))",
      "tests/test_parity.py::test_generated_models_match_transformers"),
    m("sizer-not-shared", "the batch sizer counts a prompt's shared prefix once (TrieSizer)",
      "basal_local/engine/packer.py",
      "added += self.tries.setdefault((spec.lang, prefix, used), PrefixTrie()).insert(ids, 0)", "added += len(ids)",
      "tests/test_queue_order.py"),
    # hygiene and the harness
    m("assert-in-product", "runtime checks are errors, not asserts stripped by python -O",
      "basal_local/model/config.py", "        if not isinstance(rope, dict):\n            raise ConfigError(",
      "        assert isinstance(rope, dict)\n        if False:\n            raise ConfigError(",
      "tests/test_packaging.py::test_no_assert_statements_in_the_product"),
    m("wheel-misses-torch", "the wheel installs basal_local.backends.torch",
      "pyproject.toml", '    "basal_local.backends.torch",\n', "",
      "tests/test_packaging.py::test_wheel_installs_under_one_namespace"),
    m("daemon-pipe-undrained", "the test daemon's output is drained (a chatty daemon cannot hang the run)",
      "tests/conftest.py", "        for line in self.proc.stdout:\n            self._lines.append(line)",
      "        return", "tests/test_harness.py"),
    # hostile model files, privacy between local clients, drain, limits (issue 30)
    m("head-unbounded", "every evidence-head tensor is bounded by its storage",
      "basal_local/model/evidence_head.py", "    if last >= storage.size or numel",
      "    if False and last >= storage.size or numel", "tests/test_hostile_files.py"),
    m("calibration-nan", "CALIBRATION.json temperatures NaN, 0 or subnormal are refused at load",
      "basal_local/model/directory.py", "or not math.isfinite(value)\n                or not low <= value <= high):",
      "or value <= 0):", "tests/test_hostile_files.py"),
    m("error-record-text", "error records keep codes, never the message (it may quote the state)",
      "basal_local/server/app.py", "call.error = error_summary(err.body)",
      "call.error = json.dumps(err.body, ensure_ascii=False)", "tests/test_privacy.py"),
    m("detail-public", "questions and answers only with the dashboard token or the API key",
      "basal_local/server/events.py",
      "    if not privileged(request.headers, state.dashboard_token, state.api_key_set):\n        record =",
      "    if False:\n        record =", "tests/test_privacy.py"),
    m("request-id-reused", "a request id in use is not reused (no client overwrites another's record)",
      "basal_local/telemetry/__init__.py",
      "if len(request_id) > 128 or request_id in self._pending or request_id in self._by_id:",
      "if len(request_id) > 128:", "tests/test_privacy.py"),
    m("drain-plain-500", "requests cut by the drain get the dialect's 503 + Retry-After",
      "basal_local/server/daemon.py", "app = DrainGuard(Guard(create_app(state), policy), settings.drain_s)",
      "app = Guard(create_app(state), policy)", "tests/test_drain.py"),
    m("malformed-http-plain", "malformed HTTP gets a JSON 400",
      "basal_local/server/daemon.py", "        def send_400_response(self, msg: str) -> None:",
      "        def _unused_400_response(self, msg: str) -> None:",
      "tests/test_drain.py::test_malformed_http_gets_a_json_400"),
    m("gzip-bomb-whole", "a gzip bomb is bounded while it streams (peak memory near the limit)",
      "basal_local/server/body.py", "            out += d.decompress(data, _PIECE)",
      "            out += d.decompress(data)",
      "tests/test_blind_spots.py::test_a_bomb_is_bounded_while_it_streams"),
    m("act-score-as-choice", "act with base score uses the score temperature",
      "basal_local/protocol/act.py", '    if base == "score":\n        return "score"',
      '    if base == "score":\n        return "choice"',
      "tests/test_blind_spots.py::test_act_with_base_score_is_calibrated_with_the_score_temperature"),
    m("act-max-error-equal", "act max_error refuses only strictly below the threshold",
      "basal_local/protocol/act.py", "elif confidence < threshold and", "elif confidence <= threshold and",
      "tests/test_blind_spots.py::test_act_max_error_refuses_only_strictly_below_the_threshold"),
    m("evidence-span-unbounded", "evidence spans are at most 80 tokens",
      "basal_local/protocol/evidence.py", "valid = (j_idx >= i_idx) & (j_idx < i_idx + MAX_SPAN_TOKENS)",
      "valid = j_idx >= i_idx", "tests/test_blind_spots.py::test_evidence_spans_respect_the_80_token_limit"),
    m("host-substring", "Host names match exactly (localhost.evil.com refused)",
      "basal_local/server/security.py", 'if host in LOOPBACK_NAMES or host.endswith(".localhost"):',
      'if any(name in host for name in LOOPBACK_NAMES):', "tests/test_blind_spots.py"),
    m("host-bracket-suffix", "a Host of `[::1].evil` is not ::1",
      "basal_local/server/security.py", "    if port and not (port.startswith", "    if False and not (port.startswith",
      "tests/test_blind_spots.py"),
    m("queue-includes-compute", "queue time ends when the batch starts",
      "basal_local/engine/engine.py", "queue_ms = (started - job.arrival) * 1000.0",
      "queue_ms = (time.perf_counter() - job.arrival) * 1000.0",
      "tests/test_blind_spots.py::test_queue_time_ends_when_the_batch_starts"),
]

