/*
 * postpone.c -- model check: a timer's state word, fire against postpone
 * (docs/design.rst, rule 12).
 *
 * Property: a postpone's answer is true to what the pass does:
 *   - BT_POSTPONED: the pass never fires the timer at its old key; it fires
 *     it at the new deadline;
 *   - BT_TOO_LATE: the pass had fired it at the old key;
 * and the timer runs exactly once either way.
 *
 * Code under test: bt_postpone (csrc/bucket.c), claim_due and apply_move
 * (csrc/pass.c) and take_posted (csrc/port.c), as they are; see slot.h for
 * the stubs.  The bucket mutex is model.h's.
 *
 * Threads and bounds: the timer thread and the consumer (one thread: pop at
 * KEY, pop again at the new key if it was postponed, take) against one
 * postpone to LATER: 2 threads.  A CAS here fails only on the other
 * thread's write (MOVED, or POSTED), after which the next trip ends the
 * loop, so 2 trips are enough; --unwinding-assertions proves it (3 take
 * three times as long):
 * unwind 2
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation fire-ignores-move sc+weak pass.c: if (w & BT_F_MOVED) return apply_move(tt, t) ? CLAIM_MOVED : CLAIM_DEAD; => (void)0;
 * mutation move-not-applied sc pass.c: BT_STORE(t->deadline, BT_LOAD(t->moved_to)); => (void)0;
 */
#include "slot.h"

static int postpone_rc;

int main(void) {
    slot_init();
__CPROVER_ASYNC_1:
    timer_thread();
    postpone_rc = bt_postpone(&core, id_of(GEN), LATER);
    model_join(done_pass);

    __CPROVER_assert(postpone_rc == BT_POSTPONED || postpone_rc == BT_TOO_LATE,
                     "a postpone of a live, later deadline is POSTPONED or TOO_LATE");
    __CPROVER_assert(postpone_rc != BT_POSTPONED || fired_key == LATER,
                     "a postponed timer fires at its new deadline, never its old key");
    __CPROVER_assert(postpone_rc != BT_TOO_LATE || fired_key == KEY,
                     "a postpone is too late only once the timer fired");
    __CPROVER_assert(ran, "the timer runs once");
    return 0;
}
