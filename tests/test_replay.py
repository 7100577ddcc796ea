"""Determinism: every recorded history must replay against today's workflow code.

NodeJoin's histories are recorded here (``GPUFLEET_RECORD=1 pytest
tests/test_replay.py``); the other workflows' scenario tests record theirs
through ``tests.replay.replay_and_record``. Commit the files under
tests/histories/ together with the workflow change they belong to.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from tests.conftest import Stack, wait_for
from tests.replay import HISTORIES, replay_and_record, replay_file, replay_history

#: Histories each workflow's tests must have recorded. Old ones stay while they guard runs that
#: can be in flight, and go with the patch whose old path they took (docs/design/patches.md,
#: "Retired": NodeJoin's runs before ``join-patches-at-start``, the rollouts before
#: ``rollout-source-from-config``, the sweep before ``sweep-identity-records``, the evacuations
#: before ``evacuation-abort-restores``).
EXPECTED = {
    # NodeJoin: runs of the code since the fourth retirement (docs/design/patches.md), which asks no
    # patch on these paths.
    "node_join_happy", "node_join_count2", "node_join_smoke_failed",
    # A join cancelled while waiting for registration deletes its machine and ends cancelled, not
    # failed (tests/test_join_cancelled.py; no patch: only the run's last command differs).
    "node_join_cancelled",
    # A cancel does not stop a failed join's clean-up; a join cancelled mid-create deletes its join
    # token too (tests/test_join_cancelled.py, tests/test_node_join.py).
    "node_join_failed_clean_up_cancelled", "node_join_cancelled_mid_create",
    # A join cancelled mid-create whose create then failed (no capacity) still deletes its join
    # token and ends cancelled, not failed (tests/test_node_join.py; no patch: the old code's run
    # failed in the task that took the create's failure, so no open run is past that point).
    "node_join_cancelled_mid_create_no_capacity",
    # The provisioning activity looks the site up (no local activity), so a join cancelled while a
    # progress query was answered in its first steps replays
    # (tests/test_join_cancelled.py; as a local activity the lookup's result came a task late, with
    # the cancel, and the history did not replay).
    "node_join_cancelled_while_queried_in_site_lookup",
    # A join of one node by hand looks its site up first and refuses one whose max_nodes is 0 before
    # it buys (``join-by-hand-refuses-max-nodes-0``, tests/test_node_join.py); ``_before``, the code
    # before, which bought the machine and joined it, replays down the old branch.
    "node_join_by_hand_refused_at_max_nodes_0", "node_join_by_hand_refused_at_max_nodes_0_before",
    "node_join_by_hand_looks_its_site_up",
    # The same cancel and query during the first task of a join by hand, whose lookup is now
    # ``resolve_site``: it buys nothing and replays (tests/test_join_cancelled.py; the run above,
    # of the code before, was cancelled in its provisioning activity).
    "node_join_cancelled_while_queried_in_site_lookup_by_hand",
    "node_entity_health_watch", "node_entity_watch_from_join_state",
    "capacity_no_capacity_fallback", "capacity_over_quota", "capacity_bad_credentials", "capacity_wait_then_resume",
    # A catalog refresh wakes only the requests waiting for capacity, and only when its offers changed;
    # a request it woke reads what it listed (``get_catalog`` not forced) where it listed every site
    # again (tests/test_capacity.py; no patch: the same commands, an activity's input differs).
    "capacity_woken_reads_the_refreshed_catalog", "catalog_refresh_offers_unchanged",
    "account_quota_raised", "account_credentials_rotated", "site_fill_below_min", "site_retire_above_max",
    # A report whose guard-store write was refused past its retries (a 403) is shown and written
    # again after a pause, then notified (tests/test_capacity.py; no patch, as the Site's below).
    "account_guard_write_refused_then_written",
    "site_counts_joins",
    # A reconcile refused past its retries (a 403 listing the site's nodes) is shown and tried again
    # after a pause; the entity then fills to its min (tests/test_site_reclaim.py; no patch: the
    # old code's run failed in the task that took the refusal, so no open run is past that point).
    "site_reconcile_refused_then_fills",
    "spot_reclaim",
    "gpu_repair_reset", "gpu_repair_reboot_after_reset", "gpu_repair_covered", "node_entity_two_repairs",
    # A cancelled repair stops where it is (tests/test_repair_cancel.py).
    "gpu_repair_cancelled", "gpu_repair_cancelled_replacing",
    "node_entity_repair_cancelled", "node_entity_repair_cancelled_before",
    # A person's way out for a GPU held for a person: ``return_gpu`` and ``repair_gpu`` updates on the
    # Node entity (tests/test_repair_needs_person.py).
    "node_entity_gpu_returned", "node_entity_gpu_retried",
    # An update in an entity run's first task (as a continued run's) waits for ``run`` to take its
    # state (``Entity.until_started``) where it was checked against none and refused.
    "node_entity_gpu_returned_in_its_first_task", "account_rotated_in_its_first_task",
    # A repair held in its run's first task (update-with-start) starts held (tests/test_repair.py;
    # no patch: such a hold was refused before, so no older history holds one).
    "gpu_repair_held_at_start",
    # A repair started by hand with a ``gpus`` that is not the node's is refused at start
    # (tests/test_repair.py).
    "gpu_repair_refused_gpus",
    # ... and one with a ``site`` that is not the node's (tests/test_repair.py).
    "gpu_repair_refused_site",
    "node_entity_two_repairs_local_facts", "node_entity_two_repairs_contain_first",
    "site_incident_tripped",
    "advisor_report",
    # Constraints for a model no workload serves are refused, naming ``constraints.<model>``
    # (tests/test_advisor_workflow.py).
    "advisor_refused_unserved_constraints",
    # Evacuations through the Routing entity; the Routing entity itself.
    "site_evacuation_resumed_routed",
    "site_evacuation_continued_as_new_routed", "site_evacuation_restored_after_continue_as_new_routed",
    "site_evacuation_continued_as_new_placing_routed",
    "routing_events_and_samples",
    # An entity started afresh for what the fleet lacks is refused, naming the field
    # (``account-checked-against-config``, ``routing-checks-its-model``; tests/test_bad_input.py);
    # the old code's runs of such typos, which ran for good, replay too, and so do continued runs
    # whose account left the config or whose model no site serves, which run on and say so.
    "account_refused_not_in_config", "account_refused_not_in_config_before", "account_not_in_config_any_more",
    "routing_refused_unknown_model", "routing_refused_unknown_model_before", "routing_model_served_nowhere_any_more",
    # A join token that expires before the machine can register, or join timeouts past the longest
    # token, refuse the start (tests/test_bad_input.py).
    "join_refused_a_token_that_expires_first", "capacity_refused_join_timeouts_past_a_token",
    # A start that sets state a run carries over continue-as-new is refused, naming the field
    # (``input-guard-refuses-callers-carry``, workers/input_guard.py; tests/test_bad_input.py). Runs
    # started so before it replay without its marker: ``account_not_in_config_any_more``,
    # ``routing_model_served_nowhere_any_more``, ``account_rotated_in_its_first_task`` and
    # ``node_entity_gpu_returned_in_its_first_task`` (each started as a continued run by a test).
    "capacity_refused_a_callers_carry",
    # The Routing entity on its watch, no timer (issue 37: ``routing-events``).
    "routing_events_and_samples_on_watch",
    # Started with its first event (signal-with-start): the event kept since ``start_with``; the
    # run of the code before, which lost it, replays too (tests/test_routing_entity.py).
    "routing_started_with_an_event", "routing_started_with_an_event_lost",
    # Events with long details: the reason is shortened to fit the document (tests/test_routing_entity.py).
    "routing_long_event_details",
    # A Node run whose first task held a NotReady (tests/test_site_events.py): kept since
    # ``node-patches-at-start-2``; the old code's run, which dropped it, replays too.
    "node_cluster_state_in_the_first_task", "node_cluster_state_in_the_first_task_lost",
    # A node answering every watch at once, paced (tests/security/test_watch_pacing.py); and one
    # whose answers make its entity continue as new, its pace carried (``node-patches-at-start-8``:
    # the run's first watch waits out the pause the run before was in).
    "node_watch_paced", "node_watch_paced_across_continue_as_new",
    # A node failing every watch at once, paced (``node-paces-failed-watches``,
    # tests/security/test_watch_pacing.py); the ``_before`` run, recorded on the code before (twelve
    # failures, each watched again at once), replays.
    "node_watch_failures_paced", "node_watch_failures_paced_before",
    # A node padding every watch answer while its repair runs (the run may not continue as new):
    # past its history bound each next watch waits twice as long (``node-paces-a-long-history``,
    # tests/security/test_history_limits.py); the ``_before`` run, recorded on the code before (no
    # pause, terminated by the server at its history limit), replays.
    "node_paces_a_long_history", "node_paces_a_long_history_before",
    # A node whose GPU 0 ladder is exhausted, waiting for a person, while GPU 1 keeps answering: the
    # run continues as new with the repair running and the next run follows it, grants its reset and
    # sees it end (``node-continues-while-repairing``, tests/test_entity_gate.py); the ``_before`` run,
    # recorded on the code before (no continue-as-new, GPU 1's watch paced past the history bound),
    # replays.
    "node_entity_continues_while_a_repair_waits", "node_entity_continues_while_a_repair_waits_before",
    "node_entity_follows_a_carried_repair_to_its_end",
    # A node gone from the cluster (retired by its site, or deleted by hand): its Site entity tells its
    # Node entity, which confirms it with the cluster and ends within seconds; a word reaching a node
    # in the cluster again ends nothing (``site-tells-deleted-nodes``, ``node-ends-when-told-deleted``,
    # tests/test_site_node_gone.py); the ``_before`` runs, recorded on the code before (nobody told,
    # the entity running on; the word taken as NotReady), replay down the old branches.
    "site_tells_a_retired_node_it_is_deleted", "site_tells_a_retired_node_it_is_deleted_before",
    "node_entity_ends_when_its_site_saw_it_retired",
    "node_entity_ends_when_its_site_saw_it_deleted", "node_entity_ends_when_its_site_saw_it_deleted_before",
    "node_entity_told_deleted_while_in_the_cluster", "node_entity_told_deleted_while_in_the_cluster_before",
    # The word that came while a repair of the node ran, taken again once the repair was cancelled: the
    # entity ends "gone" (``node-takes-told-deleted-after-its-repair``,
    # tests/test_node_told_deleted_while_repairing.py); the ``_before`` run, recorded on the code before
    # (the word dropped, the entity held for a person on a node the cluster no longer has), replays.
    "node_entity_told_deleted_while_repairing", "node_entity_told_deleted_while_repairing_before",
    # A node padding every early watch answer to ~120 KB, a new digest each: each counts for the pace
    # as 8 (one per 16 KiB begun), paced after 4 (``node-paces-answer-bytes``,
    # tests/security/test_watch_pacing.py); the ``_before`` run, recorded on the code before (ten such
    # answers, each counted once, none paced), replays down the old branch.
    "node_paces_answer_bytes", "node_paces_answer_bytes_before",
    # A node padding every watch answer past its bytes budget (512 KiB, 256 KiB an hour, whatever the
    # answers' timing): the next watch waits until they are paid for (``node-charges-every-answer-bytes``,
    # tests/security/test_watch_pacing.py); the ``_before`` run, recorded on the code before (paced by
    # counts alone, an answer at half the wait uncharged), replays down the old branch.
    "node_charges_every_answer_bytes", "node_charges_every_answer_bytes_before",
    # A GPU held for its site's incident, asked about after a pause that doubles, and at once when the
    # Site entity tells its node the incident closed (``node-paces-held-rechecks``, ``site-tells-held-nodes``,
    # tests/test_evacuation.py); the ``_before`` runs, recorded on the code before (an ask every
    # ``recheck_seconds``, nobody told), replay down the old branches.
    "node_held_for_an_incident_told_when_it_closes", "node_held_for_an_incident_told_when_it_closes_before",
    "site_tells_held_nodes_when_the_incident_closes", "site_tells_held_nodes_when_the_incident_closes_before",
    # A flood of junk CSRs: the approver's watch paced ever slower while its passes only deny, back to
    # the base once one approves (tests/cluster/test_csr_flood.py; no patch: the same commands, a
    # watch's input differs).
    "csr_approver_paced_flood",
    # The same flood, hundreds of long-named CSRs a round: the watch hands on a mark of what it saw,
    # not the names, and a pass lists ten verdicts, cut (tests/cluster/test_csr_flood.py; no patch:
    # the same commands, the inputs and results differ). csr_approver_paced_flood's run, whose
    # watches were told the names (``known``), replays too, and such an input is still honoured.
    "csr_approver_compact_flood",
    # An approver cancelled while its first pass was in flight ends with what it decided
    # (``approver-cancelled-in-its-first-pass-ends``, deprecated; tests/cluster/test_csr_flood.py).
    "csr_approver_cancelled_in_its_first_pass",
    "rollout_happy_routed", "rollout_canary_failed_routed", "rollout_aborted_routed",
    # An abort after a scale put v1 back (its rollback knows the templates: tests/rollout).
    "rollout_aborted_after_a_scale",
    # An abort during a readiness wait cuts it short (tests/rollout/test_rollout_workflow.py).
    "rollout_aborted_while_waiting_for_ready",
    # A rollback that failed says so and needs a person (tests/rollout/test_rollback_failed.py).
    "rollout_aborted_rollback_failed",
    # Aborted in its run's first task (update-with-start): taken, where it was refused as "still
    # starting" (no patch: a refused update leaves nothing in a history).
    "rollout_aborted_in_its_first_task",
    "rollout_pauses_before_a_canary_back_from_evacuation",
    # Temporal's cancel rolls back every site a rollout changed, as an abort does, and the run ends
    # Canceled (tests/rollout/test_rollout_workflow.py; no patch: the code before ended the run at
    # the cancel, so no open run has one in its history).
    "rollout_cancelled_while_waiting_for_ready", "rollout_cancelled_while_baking",
    "rollout_cancelled_while_a_site_is_evacuated",
    # A cancel while an abort rolls back stops no rollback, then the run ends Canceled, not aborted
    # (no patch: only the run's last command differs, and a run that took it has closed).
    "rollout_cancelled_during_an_aborts_rollback",
    # A cancel during a site's update waits for its answer and rolls that site back; an update that
    # failed after writing the Deployment is rolled back (tests/rollout/test_rollout_workflow.py).
    "rollout_cancelled_while_updating", "rollout_update_failed_half_applied",
    # A site its replicas fill is updated one replica at a time, the details saying so (tests/rollout/
    # test_rollout_workflow.py; no patch: update_serving decides, and only the details differ).
    "rollout_full_site_one_at_a_time",
    # A model under another served model's Kubernetes name is refused at start, naming ``model``
    # (tests/rollout/test_rollout_workflow.py; no patch: the look-up's input carries the model and
    # its result the refusal, so a run recorded before, with neither, takes the same path).
    "rollout_refused_kubernetes_name_clash",
    # Sites all under evacuation are waited for in one activity, and the rollout continues as new in
    # that wait when told to (tests/rollout/test_rollout_workflow.py): its first run, the run that
    # finished after it, an abort and a cancel during the wait.
    "rollout_waits_out_an_evacuation_in_one_activity", "rollout_continued_as_new_while_deferred",
    "rollout_finished_after_continue_as_new",
    # A copy the rollout stops (an abort, Temporal's cancel) aborts its open multipart upload, and the
    # rollout waits for it; once every copy has ended, the uploads left open under the rollout's prefix
    # at each site whose copy did not finish (one failed for good here) are aborted
    # (``rollout-aborts-open-uploads``, deprecated; tests/rollout/test_rollout_workflow.py).
    "rollout_aborted_while_copying", "rollout_cancelled_while_copying", "rollout_copy_failed_aborts_its_upload",
    # The newest spot notice sets the deadline (tests/test_reclaim_deadline.py).
    "spot_reclaim_earlier_notice", "spot_reclaim_later_notice",
    # A cancelled reclaim uncordons its node and stops its replacement (tests/test_reclaim_deadline.py).
    "spot_reclaim_cancelled_while_draining", "spot_reclaim_cancelled_waiting_for_the_replacement",
    # The HTTP relay of an operator update (tests/test_entity_update.py).
    "entity_update_quota_raised", "entity_update_rejected",
    # The demand loop: pods bought for, bound, gone; their idle nodes retired (tests/test_demand_loop.py).
    "demand_buy_then_retire",
    # Consolidation leaves a node a repair contained (cordoned by someone else) idle and in place
    # (tests/test_demand_loop.py; no patch: the same commands, the idle list now says who cordoned).
    "demand_leaves_a_contained_node",
    # A node the loop's blocked drain left cordoned: let go once a repair holds it (a GPU fenced);
    # and known as the loop's own from the cluster's mark (gpufleet.io/cordoned-by) by a run that
    # does not carry it, then retired (tests/test_demand_loop.py; no patch: the same commands, the
    # drain's input and the idle list now carry who cordoned).
    "demand_lets_go_a_node_a_repair_took", "demand_retires_a_node_it_left_cordoned",
    # A retirement keeps a node a repair took during its drain (a GPU fenced): node, machine and
    # cordon left to the repair (tests/test_demand_loop.py; no patch: the same commands, the retire
    # activity's input carries the loop's mark and its result who holds the node, None before).
    "demand_keeps_a_node_a_repair_took_during_its_drain",
    # ... and one a person took (cordoned, marked theirs) right before its drain's cordon: that
    # cordon, made on the marks the drain read, is refused, and the drain says who holds the node
    # (no patch: no drain result recorded before ``DrainResult.held`` has it; those take the old branches).
    "demand_keeps_a_node_a_person_took_before_its_drain",
    # A failed pass is no end of the entity: the cluster refused the demand loop's watch, then the
    # Routing entity's sample; each said so, paused and passed again, its state kept
    # (tests/test_demand_loop.py, tests/test_routing_entity.py; no patch: the code before failed the
    # run there). The loop's fresh run numbers its purchases in a series of its own
    # (``demand-purchase-series``).
    "demand_outlives_a_refused_watch", "routing_outlives_a_refused_sample",
    # A cancelled demand loop winds down before it ends: it stops its purchase still buying (and one
    # whose start was in flight, once started) and uncordons the node it was draining, saying so
    # (``demand-cancel-winds-down``, tests/test_demand_loop.py); ``_before``: the code before, which
    # ended at the cancel (during a drain, during a purchase's start), replays too.
    "demand_cancelled_stops_its_purchase", "demand_cancelled_as_its_purchase_starts",
    "demand_cancelled_uncordons_its_drain", "demand_cancelled_while_draining_before",
    "demand_cancelled_as_its_purchase_starts_before",
    # From the watch that saw new Pending pods to their purchases the loop runs one activity,
    # ``plan_and_buy`` (``demand-plans-and-buys-in-one-step``, tests/test_demand_loop.py), a cancel
    # while it starts one awaiting its answer; ``_before``: the code before (``get_catalog``,
    # ``plan_demand``, ``start_purchase``), recorded on it, replays down the old branch (as do
    # ``demand_buy_then_retire`` and the other demand histories above, and
    # ``demand_cancelled_as_its_purchase_starts``, whose start was in flight as the cancel landed).
    "demand_plans_and_buys_in_one_step", "demand_plans_and_buys_in_one_step_before",
    "demand_cancelled_as_its_step_starts_a_purchase",
    # A loop cancelled while that step failed after a start takes the purchase it started from
    # Temporal (``started_purchases``) and stops it (the same patch: a path no earlier run took).
    "demand_cancelled_as_its_step_fails_after_a_start",
    # A purchase kept after its pods went (it could not be asked) is followed: a new pod waits on it,
    # and a later pass cancels it once it can be asked (``demand-follows-kept-purchases``,
    # tests/test_demand_loop.py); ``_before``: the code before, which bought beside it and never asked
    # again, replays down the old branch.
    "demand_follows_a_kept_purchase", "demand_follows_a_kept_purchase_before",
    # A site above its max retires its free nodes, never one a repair or a person holds, and one
    # freed by its repair's end; its retirement keeps a node a repair took during the drain
    # (tests/test_site_reclaim.py); an evacuation keeps a node it bought that a repair holds
    # (tests/test_evacuation.py). No patch: the same commands where no node is held, and every
    # history recorded before reads each listed node as free (``SiteNode.held``) and each retired.
    "site_above_max_leaves_held_nodes_to_their_holders", "site_above_max_keeps_a_node_a_repair_took_during_its_drain",
    "site_evacuation_keeps_a_bought_node_a_repair_holds",
    # A Site's own blocked surplus drain converges (tests/test_site_reclaim.py): back within its max
    # the Site uncordons the node, above it retires that node first (no patch: a recorded
    # ``site_nodes`` result reads no node as its own cordon, ``SiteNode.surplus_cordon``); an
    # evacuation uncordons a node it bought whose drain blocked (tests/test_evacuation.py).
    "site_back_within_max_uncordons_its_blocked_drain", "site_above_max_retires_its_blocked_drain_first",
    "site_evacuation_uncordons_a_bought_node_whose_drain_blocked",
    # Operations converge (issue 36): a capacity request refused at start or cancelled
    # (tests/test_capacity_converges.py); an evacuation that ends puts back what it changed
    # (tests/test_evacuation.py).
    "capacity_refused_at_start", "capacity_cancelled", "capacity_temporal_cancel",
    # No join starts past a capacity request's deadline (tests/test_capacity_deadline.py).
    "capacity_deadline_join_in_flight", "capacity_deadline_after_wait",
    # A request that gave up on failed joins takes each join still in flight (its node in the cost)
    # and a cancel stops them (tests/test_capacity_converges.py).
    "capacity_gave_up_join_in_flight", "capacity_cancelled_after_giving_up",
    # A count more than the eligible sites' max_nodes together is refused at start
    # (tests/test_capacity_converges.py).
    "capacity_refused_count",
    # A failed account report or catalog read ends no capacity request (nor its joins in flight): the
    # report said in its join's attempt, the read tried again after a pause (tests/
    # test_capacity_converges.py; no patch: the code before failed the run in the task that took the
    # failure). A join cancelled while its node is admitted waits for the admit's answer, then keeps
    # the node it admitted (``join-admits-to-its-end``, deprecated).
    "capacity_account_report_failed", "capacity_catalog_read_failed_then_read",
    "node_join_cancelled_while_admitting",
    # An account a failed report could not tell stays revoked over the request's catalog reads; a
    # catalog read failing on continues as new, the run it continued as checking the request.
    "capacity_account_revoked_not_told_stays_revoked", "capacity_catalog_read_failed_continued_as_new",
    "capacity_catalog_read_failed_continued_as_new_then_checked",
    "site_evacuation_restored_releases", "site_evacuation_aborted_restores", "site_evacuation_cancelled_restores",
    "site_evacuation_aborted_while_buying", "site_evacuation_aborted_restores_after_continue_as_new",
    "site_evacuation_aborted_in_its_first_task",
    # An evacuation asks for what its target sites' max_nodes hold, not more (tests/test_evacuation.py;
    # no patch: facts recorded before carry no max_nodes, and such a run asks for the whole count).
    "site_evacuation_capacity_capped",
    "site_evacuation_looked_at_in_its_first_task",
    "site_evacuation_recovered_in_its_first_task",
    # Temporal's cancel ends an evacuation at any step as an abort does, and the run cancelled
    # (tests/test_evacuation.py).
    "site_evacuation_cancelled_waiting_for_replicas_elsewhere", "site_evacuation_cancelled_in_its_first_step",
    "site_evacuation_cancelled_while_proving",
    # What an abort or a failed step puts back runs to its end when a cancel lands meanwhile.
    "site_evacuation_cancelled_while_putting_back_after_abort", "site_evacuation_cancelled_while_putting_back_after_failure",
    # An abort waits to the end for the capacity request it stopped, and retires the node it joined,
    # when a cancel lands meanwhile.
    "site_evacuation_cancelled_while_an_abort_waits_for_capacity",
    # A full site's Deployments go to 0 before its drain, which then ends at once
    # (tests/test_evacuation.py).
    "site_evacuation_scales_down_before_draining",
    # An abort cuts short the evacuation's wait for its replicas elsewhere, and its drain
    # (``evacuation-abort-cuts-waits``, deprecated; tests/test_evacuation.py).
    "site_evacuation_aborted_waiting_for_replicas_elsewhere", "site_evacuation_aborted_while_draining",
    "site_evacuation_drain_failed_the_others_stopped",
    # Declared recovered, a proof no node passed, its failing nodes fewer than would trip an
    # incident, restores the site and hands them to repair (``evacuation-declared-recovered-restores-
    # unproven``, tests/test_evacuation.py); the old code's run, which waited on until aborted, replays.
    "site_evacuation_declared_recovered_restores_unproven",
    "site_evacuation_declared_recovered_restores_unproven_before",
    # A node that fails the proof on GPU 3 is quarantined on GPU 3: that GPU is fenced and repaired,
    # not GPU 0 (``evacuation-quarantines-the-failing-gpus``, tests/security/test_evacuation_proof.py);
    # the old code's runs, which quarantined GPU 0, replay.
    "site_evacuation_quarantines_the_failing_gpu", "site_evacuation_quarantines_the_failing_gpu_before",
    "node_entity_quarantined_on_the_failing_gpu", "node_entity_quarantined_on_the_failing_gpu_before",
    # A node whose agent cannot run its compute check stays cordoned, unproven, for a person, and is
    # not handed to the repair ladder (``evacuation-holds-where-the-check-cannot-run``,
    # tests/security/test_evacuation_proof.py); the old code's run, which quarantined it, replays.
    "site_evacuation_holds_where_the_check_cannot_run", "site_evacuation_holds_where_the_check_cannot_run_before",
    # ... and is told to its Node entity, which holds it for a person (needs-person, the alert) and
    # starts no repair; `return_gpu` of GPU 0 uncordons it (``evacuation-tells-the-node-it-waits-for-a-person``);
    # the run before, which told it nothing, is ``site_evacuation_holds_where_the_check_cannot_run``.
    "site_evacuation_tells_the_node_it_waits_for_a_person", "node_entity_holds_for_a_person_where_the_check_cannot_run",
    # A quarantine naming GPUs or a hold is taken behind the Node's own patch, asked in its handler
    # (``node-quarantine-takes-gpus-and-holds``): a run whose worker of the release before dropped
    # both payloads replays (``..._before``, recorded on a handler that drops them as that model did).
    "node_entity_quarantine_takes_gpus_and_holds", "node_entity_quarantine_takes_gpus_and_holds_before",
    # While its site is down, and while nothing may take its replicas, an evacuation waits on one
    # ``watch_recovery`` that probes inside the activity, which ``recovered`` cuts short
    # (tests/test_evacuation.py).
    "site_evacuation_watches_recovery", "site_evacuation_recovered_cuts_the_watch_short",
    "site_evacuation_watches_the_needs_person_wait",
    # Patches decided at the start of a run (a patch asked after a local activity could not replay).
    "node_entity_two_repairs_patches_at_start",
    "node_entity_self_labels_patches_at_start", "node_bad_reports_quarantine_patches_at_start",
    # "All" is said, never implied (issue 36): quota_raised with {"all": true}.
    "account_quota_raised_all_explicit",
    # A report during the account's wait to continue as new is taken first (tests/test_account_gate.py).
    "account_continue_when_ready",
    # An update whose guard write fails puts the account back as it was and can be sent again
    # (``account-update-puts-back-on-a-failed-write``, tests/test_capacity.py); the old code's run,
    # which kept the unwritten change, replays too.
    "account_update_write_refused_puts_back", "account_update_write_refused_puts_back_before",
    # A rotation whose queued deletes fail past their retries is taken, the deletes owed and tried
    # again by the entity's loop until they run, kept while revoked again, and carried over
    # continue-as-new (``account-owes-failed-deletes``, tests/test_capacity.py); the old code's run,
    # whose update failed and whose second rotation was refused, the machine left up, replays too.
    "account_rotation_owes_failed_deletes", "account_rotation_owes_failed_deletes_before",
    "account_deletes_owed_carried_over_continue_as_new",
    # A run started afresh after its run before was terminated owing deletes reads them from the
    # guard store, owes them and runs them (``account-started-afresh-takes-queued-deletes``,
    # tests/test_capacity.py); the old code's fresh run, which owed nothing, the machine left up, replays too.
    "account_started_again_runs_the_deletes_owed", "account_started_again_runs_the_deletes_owed_before",
    # The deletes queued while revoked are read from the guard store and shown (status, details,
    # ``gpufleet accounts list`` and ``show``) until a rotation runs them, over continue-as-new and in a
    # run started afresh (``account-shows-queued-deletes``, tests/test_capacity.py); the old code's
    # run, which never read them, replays too.
    "account_shows_queued_deletes", "account_shows_queued_deletes_then_continued",
    "account_started_afresh_shows_queued_deletes", "account_shows_queued_deletes_before",
    # A run started afresh takes the account as the guard store holds it (revoked, the offers blocked):
    # it says so, and takes the rotation or the quota raised (``account-started-afresh-takes-the-guard``,
    # tests/test_capacity.py); the old code's fresh run, which said healthy and refused the rotation
    # until a report came, replays too.
    "account_started_afresh_takes_the_guard", "account_started_afresh_takes_the_guard_quota",
    "account_started_afresh_takes_the_guard_before",
    # A run started afresh whose read of the guard store failed, asked to continue as new before a read
    # landed, carries that it has not read it: the next run reads it and takes the revocation
    # (``account-carries-the-guard-unread``, tests/test_capacity.py); the old code's run, which carried
    # nothing and left the next one healthy for good, replays too.
    "account_carries_the_guard_unread", "account_carries_the_guard_unread_then_read",
    "account_carries_the_guard_unread_before",
    # The entity gate (issue 38): a Node continues as new only once its watch loop rests, so the run
    # that took a spot notice starts the SpotReclaim (tests/test_entity_gate.py).
    "node_entity_continued_as_new_after_reclaim",
    # A repair cancelled while its request for the node's action slot was queued is not granted the
    # slot, and no action is recorded for it (``node-patches-at-start-3``, tests/test_node_slot_requests.py);
    # the old code's run, which granted it and let that phantom reboot cover a later fault, replays too.
    "node_entity_queued_request_of_an_ended_repair", "node_entity_queued_request_of_an_ended_repair_before",
    # A repair queued for the slot is told who holds it and until when, again as the holder changes
    # (``node-patches-at-start-5``, tests/test_node_slot_requests.py): the Node run that told it, and
    # the queued repair's run that took it into its details (no patch there: a signal handler, no command).
    "node_entity_tells_the_queue_who_holds_the_slot", "gpu_repair_told_who_holds_the_slot",
    # ... once as it queues, with when its own turn comes, and again only as the next in line: 2Q-3
    # signals for Q repairs queued, not Q(Q-1)/2 (``node-tells-the-queue-once``); ``_before``: the
    # code before, which told every waiter again at each hand-over, replays too.
    "node_entity_tells_a_queue_of_five_once", "node_entity_tells_the_queue_who_holds_the_slot_before",
    # A node's well-formed answers as large as they may be, past two continues-as-new: the state keeps
    # only what later decisions need, for GPUs the node has (tests/security/test_node_reports.py).
    "node_carry_bounded_after_bloated_answers",
    # Fatal XIDs on 64 GPUs of a 2-GPU node: the 62 it lacks read no facts (``node-patches-at-start-4``,
    # tests/security/test_node_reports.py); ``node_carry_bounded_after_bloated_answers``, the code
    # before reading them for each, replays too.
    "node_fatal_xids_on_gpus_it_lacks",
    # A reclaim notice from a node at an on-demand site is a bad report, no SpotReclaim
    # (``node-patches-at-start-6``, tests/security/test_node_reports.py); ``_before``: the code
    # before, which started the node's SpotReclaim, replays too.
    "node_reclaim_notice_at_an_on_demand_site", "node_reclaim_notice_at_an_on_demand_site_before",
    # A Node entity whose read of the node fails (the cluster refuses it) keeps the finding on hold and
    # reads again after a growing pause, then fences and repairs (tests/test_repair.py; no patch: the
    # code before failed the run in the task that took the failure, so no open run is past it).
    "node_entity_repairs_once_the_cluster_answers",
    # A person's ``repair_gpu`` while the cluster refuses the read is refused ``ClusterUnavailable``,
    # nothing kept (tests/test_repair_needs_person.py); ``_before``: the code before, whose update
    # failed with the bare activity error, replays: the same commands, only the update's failure differs.
    "node_entity_retried_after_the_cluster_refused", "node_entity_retried_after_the_cluster_refused_before",
    # A Site entity started again numbers its next incident past the evacuations on record, and takes
    # one still running as its open incident (``site-evacuation-ids-unique``, tests/test_evacuation.py);
    # the code before replays in ``site_incident_tripped``, ``site_events_notready_trips``,
    # ``site_incident_carried``.
    "site_numbers_incidents_past_those_on_record", "site_takes_a_running_evacuation_as_its_incident",
    # A Site entity started again numbers its next fill past the fills on record, and takes one still
    # running as its fill (``site-fill-ids-unique``, tests/test_site_reclaim.py); the code before
    # replays in ``site_fill_below_min``, ``site_reconcile_refused_then_fills``.
    "site_numbers_fills_past_those_on_record", "site_takes_a_running_fill_as_its_own",
    # A fill that failed (the provider refusing every machine) holds the next back for a growing pause,
    # saying why and until when; a person's ``reconcile_now`` starts it at once (``site-paces-failed-fills``,
    # tests/test_site_reclaim.py). ``_before``: the code before, which started the next fill at once, replays.
    "site_paces_a_failed_fill", "site_paces_a_failed_fill_before",
    # A purchase one of whose pods went while it bought buys on for the other, and the Demand loop's
    # watch sleeps until the next change (tests/test_demand_loop.py; no patch: the watch is told the
    # pods seen gone, an input, and the loop issues the same commands). ``_before``: the code before,
    # whose watches returned "pods gone" at once, one after another, replays.
    "demand_purchase_partly_gone", "demand_purchase_partly_gone_before",
    # Two GPUs' resets queued one behind the other each get the slot: a reset covers no other GPU's
    # (``node-patches-at-start-7``, tests/test_node_slot_requests.py); ``_before``: the code before,
    # whose first reset "covered" the second, replays too. A continued Node run that changes nothing
    # upserts no search attribute (the same patch, tests/test_entity_gate.py).
    "node_entity_grants_each_gpu_its_own_reset", "node_entity_grants_each_gpu_its_own_reset_before",
    "node_entity_continued_changing_nothing",
    # A Site drains its surplus beside its loop: an incident that opens meanwhile is evacuated at once
    # and stops the retirement (``site-retires-beside-its-loop``, tests/test_site_events.py); the code
    # before replays in ``site_retire_above_max`` and the other ``site_above_max_*``.
    "site_incident_stops_its_surplus_retirement",
    # Entities asked to ``renew`` (``gpufleet patches renew``) continue as new at their next safe
    # point: an idle Node's loop woken from its rest, Demand's event watch cut (``entity-renews``,
    # tests/test_patches.py, tests/test_demand_loop.py). ``_before``: runs of the release before it
    # (no handler), recorded on that code, whose worker kept a ``renew`` and went on (Demand to its
    # next purchase and watches, the Node to its next watch): replayed, the signal is ignored as it
    # was (without the patch the handler cut the watch, or continued as new, where they went on).
    "node_entity_renewed", "demand_renewed_in_its_watch",
    "node_entity_renewed_before", "demand_renewed_in_its_watch_before",
    # ... a Node whose GPU is held for a person (its repair cancelled) too, the hold carried
    # (tests/test_repair_needs_person.py; no patch: the same path).
    "node_entity_renewed_held_for_a_person",
    # What an evacuation of the site left when it closed without putting back (terminated) is put back
    # by the Site entity: as its incident closes, and at a safety reconcile for a person's
    # (``site-puts-back-closed-evacuations``, tests/test_evacuation.py). ``_before``: the same
    # scenarios on the code before, which closed the incident (or looked) and left it all, replay too.
    "site_puts_back_a_terminated_evacuation", "site_puts_back_a_terminated_evacuation_before",
    # A watch result telling more Node entities than one turn (``site-tells-nodes-in-turns``).
    "site_tells_nodes_in_turns", "site_tells_nodes_in_turns_before",
    # An evacuation draining more nodes than one turn (``evacuation-drains-in-turns``, deprecated;
    # tests/test_evacuation_many_nodes.py).
    "evacuation_drains_in_turns",
    "site_puts_back_a_persons_terminated_evacuation", "site_puts_back_a_persons_terminated_evacuation_before",
    # ... and records each evacuation it put back with the site's evacuation claim, which a run started
    # again reads (``site-records-put-backs-with-the-claim``, tests/test_evacuation.py). ``_before``: the
    # same run on the code before, which remembered it in its own state only, replays too.
    "site_records_its_put_back_with_the_claim", "site_records_its_put_back_with_the_claim_before",
    # ... and a put-back that did not finish (refused at scaling back the replica it moved elsewhere) is
    # tried again at the next safety looks until done (``site-finishes-unfinished-put-backs``,
    # tests/test_evacuation.py). ``_before``: the same run on the code before, which never tried again.
    "site_finishes_an_unfinished_put_back", "site_finishes_an_unfinished_put_back_before",
    # ... and one refused for good at one of the Deployments elsewhere skips the one done and is left
    # to a person after its tries (the same patch).
    "site_leaves_an_unfinishable_put_back_to_a_person",
    # The Schedule's SiteSweep pass starts a Node entity that was terminated again
    # (``sweep-starts-node-entities``, tests/test_site_events.py). ``_before``: the same pass on the
    # code before, which started none (replayed without the patch, it fails: an activity where the
    # run completed); ``site_sweep_starts_only`` is an older such pass.
    "site_sweep_restarts_node_entities", "site_sweep_restarts_node_entities_before", "site_sweep_starts_only",
    # The pass starts the SpotReclaim of a spot node whose machine stopped without a notice, and that
    # reclaim's run (``sweep-reclaims-stopped-spot``, tests/test_site_reclaim.py). ``_before``: the same
    # pass on the code before, which reclaimed nothing.
    "site_sweep_reclaims_stopped_spot", "site_sweep_reclaims_stopped_spot_before",
    # FleetSweep deletes the machine of a node a terminated join left unproven, then removes its Node
    # and identity record (tests/test_join_terminated.py; no patch: the same commands, what the
    # activities take and answer differs).
    "fleet_sweep_abandoned_node",
    "spot_reclaim_of_a_machine_stopped_without_a_notice",
    # The Site entity of a site taken out of the fleet config with nothing left there ends, saying why;
    # one with a node left runs on, saying what is there; a run started after its site left the config
    # ends too (``site-ends-once-removed-from-config``, tests/test_site_reclaim.py). ``_before``: the code
    # before, which asked after the unknown site every 5 minutes for ever; replayed, its refusals take
    # the old path (without the patch the refused watch asked for a reconcile where it only waited).
    "site_removed_from_the_config_ends", "site_removed_from_the_config_ends_before",
    "site_removed_from_the_config_with_a_node_runs_on", "site_started_after_it_left_the_config_ends",
    # An evacuation begun before its Site entity put back what a terminated one left takes that over
    # (its facts carry it: ``EvacuationFacts.left``) and puts it back as its own (tests/test_evacuation.py;
    # no patch: a run whose facts were read before carries none, and takes the old path).
    "site_evacuation_takes_over_a_terminated_ones_leftovers",
    # A Node entity the sweep started again takes what the run before left from the cluster: a GPU an
    # ended repair left fenced is held for a person (then returned), a repair still running is followed
    # to its end (``node-started-again-takes-what-was-left``, tests/test_site_events.py). ``_before``:
    # the first on the code before, which took nothing; replayed, it takes the old path.
    "node_entity_started_again_holds_the_fenced_gpu", "node_entity_started_again_holds_the_fenced_gpu_before",
    "node_entity_started_again_follows_the_running_repair",
    # A repair read acting whose action ended while the new run read what was left: its give-back
    # counts, and its next rung is granted (not held behind itself).
    "node_entity_started_again_action_done_while_it_read",
    # A GPU the run before fenced while its site held the repair is taken on hold again and its site
    # asked again, then repaired (``node-started-again-rechecks-what-was-on-hold``). ``_before``: the
    # code before, which held it for a person; its ``node_left`` names no fence on hold: the old path.
    "node_entity_started_again_rechecks_a_gpu_fenced_on_hold",
    "node_entity_started_again_rechecks_a_gpu_fenced_on_hold_before",
    # A repair whose Node entity was terminated mid-ladder: the slot given back to no run is noted, its
    # request for the next rung's slot stays pending until the sweep's next run takes it over
    # (tests/test_site_events.py; no patch: the code before failed the run at that signal).
    "gpu_repair_outlives_its_node_entity",
    # A repair held while queued for its node's action slot gives the grant back unused and asks again
    # once released (``repair-holds-at-the-grant``, deprecated), and the Node run keeps no record of the
    # action that never ran (``node-slot-given-back-unused``; tests/test_node_slot_requests.py).
    # ``_before``: the Node on the code before, which kept the give-back as a reboot that ran.
    "gpu_repair_held_in_the_queue_gives_the_slot_back",
    "node_entity_slot_given_back_unused", "node_entity_slot_given_back_unused_before",
    # A cancel once the replacement joined retires the replaced node all the same and ends replaced
    # (``repair-replace-retires-to-its-end``, deprecated; tests/test_repair_cancel.py).
    "gpu_repair_cancelled_after_the_replacement_joined",
    # A proof whose compute check cannot run on the node (its agent's ``ComputeCheckUnavailable``) holds
    # the ladder at its rung for a person, and proves again once released
    # (``repair-holds-when-the-check-cannot-run``, tests/test_compute_check.py). ``_before``: the code
    # before, which took it for a failed proof and climbed reset, reboot, reinstall, replace.
    "gpu_repair_held_when_the_check_cannot_run", "gpu_repair_held_when_the_check_cannot_run_before",
    # A proof that could not run for a reason the agent calls transient is proved again after 1, 2, 4,
    # 8 minutes, then held (``repair-proves-again-after-a-transient-check``, tests/test_compute_check.py).
    # ``_before``: the code before, which held it for a person at once.
    "gpu_repair_proves_again_after_a_transient_check", "gpu_repair_proves_again_after_a_transient_check_then_held",
    "gpu_repair_proves_again_after_a_transient_check_before",
    # The join's end and the cancel in one workflow task, its jobs applied as one batch (temporalio's
    # logic flag 2): the join's result is taken, not lost to the cancel (tests/test_repair_cancel.py).
    "gpu_repair_cancelled_in_the_task_the_replacement_joined",
    # A request's join ended and Temporal's cancel came in the same workflow task, the cancel first and
    # the jobs applied as one batch: the join's node is counted joined, not stopped
    # (tests/test_capacity_converges.py).
    "capacity_cancelled_in_the_task_a_join_ended",
    # An offer that said NoCapacity at ``unavailable_ttl_seconds: 0`` is joined again only after the
    # request's wait for capacity (``capacity-ttl-0-waits-before-trying-again``, deprecated;
    # tests/test_capacity.py).
    "capacity_no_capacity_at_ttl_0_waits",
}


async def _scenarios(stack: Stack) -> dict[str, object]:
    """Run each NodeJoin path once and return the handles whose histories matter."""
    happy = await stack.start_join({"site": "site-a"}, request="replay-happy")
    await happy.result()
    many = await stack.start_join({"site": "site-b", "count": 2}, request="replay-many")
    await many.result()
    stack.world.set_site("site-a", boot_seconds=1.0)
    smoke = await stack.start_join({"site": "site-a", "timeouts": {"smoke_test_seconds": 5}}, request="replay-smoke")
    machine = await wait_for(lambda: [m for m in stack.world.machines("site-a") if m["name"] != ""][1:], timeout=20)
    stack.world.inject_fault(machine[0]["id"], 0, "xid", 79, clears_on="reboot")
    with pytest.raises(WorkflowFailureError):
        await smoke.result()
    return {"node_join_happy": happy, "node_join_count2": many, "node_join_smoke_failed": smoke}


async def test_fresh_histories_replay(stack: Stack) -> None:
    for name, handle in (await _scenarios(stack)).items():
        await replay_and_record(handle, name)


@pytest.mark.parametrize("path", sorted(HISTORIES.glob("*.json")), ids=lambda p: p.stem)
async def test_recorded_history_replays(path: Path) -> None:
    await replay_file(path)


#: (history, a setting its run recorded, a value for it that an older release took from sites.yaml
#: and today's refuses there): where it was recorded (start input, activity result, carry, child
#: input). An operator lowers the setting to start the new workers; every open run that recorded
#: the old value must still take it, or it fails its input on replay after the rolling restart.
PAST_TODAYS_CAPS = [
    ("gpu_repair_reset", "node_remediation_window_seconds", 60 * 86400),  # GpuRepairInput.settings
    ("node_entity_two_repairs_patches_at_start", "node_remediation_window_seconds", 60 * 86400),  # NodeEntityInput
    ("site_admit_known_nodes", "window_seconds", 60 * 86400),  # the incident_settings activity's result
    # the evacuation_facts activity's result (EvacuationFacts.settings)
    ("site_evacuation_cancelled_waiting_for_replicas_elsewhere", "capacity_deadline_seconds", 60 * 86400),
    ("site_evacuation_cancelled_waiting_for_replicas_elsewhere", "check_seconds", 2 * 86400),
    ("node_join_happy", "price_per_gpu_hour", 150_000.0),  # the provisioning activity's result (its Site)
]


def _with_setting(history: dict[str, Any], key: str, value: float) -> int:
    """Sets ``key`` to ``value`` wherever a JSON payload of ``history`` holds it (at any depth); how
    many it set."""
    def rewrite(node: Any) -> int:
        if isinstance(node, list):
            return sum(rewrite(item) for item in node)
        if not isinstance(node, dict):
            return 0
        count = int(key in node)
        if count:
            node[key] = value
        return count + sum(rewrite(item) for item in node.values())

    def walk(node: Any) -> int:
        if isinstance(node, list):
            return sum(walk(item) for item in node)
        if not isinstance(node, dict):
            return 0
        count = 0
        for payload in node.get("payloads") or []:
            data = json.loads(base64.b64decode(payload.get("data", "")) or "null")
            found = rewrite(data)
            if found:
                payload["data"] = base64.b64encode(json.dumps(data, separators=(",", ":")).encode()).decode()
            count += found
        return count + sum(walk(item) for field, item in node.items() if field != "payloads")

    return walk(history["events"])


@pytest.mark.parametrize("name, key, value", PAST_TODAYS_CAPS, ids=lambda v: str(v))
async def test_a_history_that_recorded_a_setting_past_todays_cap_replays(name: str, key: str, value: float) -> None:
    history = json.loads((HISTORIES / f"{name}.json").read_text())
    assert _with_setting(history, key, value), f"{name} recorded no {key}"
    await replay_history(history, name)


def test_histories_are_recorded() -> None:
    assert {p.stem for p in HISTORIES.glob("*.json")} >= EXPECTED
