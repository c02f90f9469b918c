/*
 * reuse.c -- model check: a slot's reuse against a holder of its previous
 * id (docs/design.rst, rules 1 and 2: cancel by versioned id).
 *
 * Property: a stale id never touches the slot's next timer.  The consumer
 * releases a timer it ran (the slot's generation is bumped, the slot
 * FREE) and a schedule reuses the slot at once, while another thread
 * cancels and then postpones with the id of the timer that ran: both answer
 * BT_TOO_LATE (they saw it RUNNING) or BT_UNKNOWN, and the new timer is
 * PENDING at its own deadline, under the new generation, whatever the
 * interleaving.
 *
 * Code under test, as it is in csrc/: bt_timer_release (port.c),
 * bt__slot_retire and bt__slot (pool.c), schedule_timer with
 * lock_with_free_slot and push_pending_locked (bucket.c), bt_cancel and
 * bt_postpone (bucket.c).  The slot directory has one block, this slot.
 * Stubbed: the wake (bt__wake_for), the collect request.
 *
 * The core, its one slot and the schedule's take of it are oneslot.h's;
 * in this model copy the slot goes back to its bucket as a count, which
 * the schedule waits for (the free list is a pointer, oneslot.h says why).
 * adapt port.c: if (bt__slot_retire(port->tt, t)) bt__pool_free_chain(port->tt, t->bucket, t, t, 1); => if (bt__slot_retire(port->tt, t)) model_freed++;
 * adapt bucket.c: struct bt_timer *t = &slot; => struct bt_timer *t = &slot;\n    __CPROVER_assume(model_freed);
 *
 * The property is the outcome of the CASes and stores on one word
 * (retire's FREE store, the schedule's PENDING store, the cancel's and the
 * postpone's compare-exchange on the generation), which coherence fixes
 * under any memory model; the PSO run shows it (publish.c checks what the
 * PENDING store publishes).  One step dropped runs under PSO too (sc+weak),
 * to show the PSO run can fail.
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation retire-keeps-generation sc+weak pool.c: uint32_t gen = BT_WORD_GEN(w) + 1; => uint32_t gen = BT_WORD_GEN(w);
 * mutation cancel-ignores-generation sc bucket.c: if (BT_WORD_GEN(w) != gen) return BT_UNKNOWN; => (void)gen;
 * mutation postpone-ignores-generation sc bucket.c: if (BT_WORD_GEN(w) != gen || BT_WORD_STATE(w) == BT_S_FREE) { => if (BT_WORD_STATE(w) == BT_S_FREE) {
 */
static int model_freed;

#include "oneslot.h"

#define NEW_DEADLINE 200

_Atomic uint64_t bt__fork_generation;
static volatile int done_owner;
static uint64_t new_id;
static int schedule_rc;

int bt__wake_for(bt_timer_thread *tt, int64_t deadline, int drain) {
    (void)tt, (void)deadline, (void)drain;
    return 0;
}

void bt__request_collect(bt_timer_thread *tt) { (void)tt; }

/* The consumer gives back the timer it ran; then its thread schedules again
 * and gets the same slot. */
static void owner(void) {
    bt_timer_release(&port, &slot);
    schedule_rc = bt_schedule_port(&core, NEW_DEADLINE, &port, NULL, &new_id);
    model_done(&done_owner);
}

int main(void) {
    oneslot_init(BT_WORD(GEN, BT_S_RUNNING)); /* the consumer ran it */
    core.gen0 = 1;
    slot.deadline = 100;
__CPROVER_ASYNC_1:
    owner();
    int cancelled = bt_cancel(&core, id_of(GEN));
    int postponed = bt_postpone(&core, id_of(GEN), 300);
    model_join(done_owner);

    uint64_t w = slot.word;
    __CPROVER_assert(schedule_rc == 0 && new_id == id_of(GEN + 1), "the slot is reused, next generation");
    __CPROVER_assert(cancelled == BT_TOO_LATE || cancelled == BT_UNKNOWN,
                     "a stale cancel answers too late or unknown");
    __CPROVER_assert(postponed == BT_TOO_LATE || postponed == BT_UNKNOWN,
                     "a stale postpone answers too late or unknown");
    __CPROVER_assert(w == BT_WORD(GEN + 1, BT_S_PENDING), "the new timer is pending, unmoved");
    __CPROVER_assert(slot.deadline == NEW_DEADLINE, "at its own deadline");
    return 0;
}
