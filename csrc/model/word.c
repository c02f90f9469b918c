/*
 * word.c -- model check: a timer's state word, fire against cancel, and a
 * stale id against both (docs/design.rst, rules 1 and 2).
 *
 * Property: exactly one outcome, and the cancel is told which:
 *   - the callback runs (the consumer's POSTED -> RUNNING succeeds) if and
 *     only if the cancel answers BT_TOO_LATE; BT_CANCELLED means it never
 *     runs; a live id is never answered BT_UNKNOWN;
 *   - a cancel with the slot's previous generation (the id of the timer the
 *     slot held before it was reused) is answered BT_UNKNOWN and changes
 *     nothing, whichever state the word is in when it looks.
 *
 * Code under test: bt_cancel (csrc/bucket.c), claim_due (csrc/pass.c) and
 * take_posted (csrc/port.c), as they are; see slot.h for the stubs.
 *
 * Threads and bounds: the timer thread and the consumer (one thread: the
 * fire, then the take) against a caller that cancels with the stale id and
 * then with the live one: 2 threads.  A cancel's CAS loop retries once per
 * write of the other thread's (POSTED, then RUNNING), so 3 trips are
 * enough; --unwinding-assertions proves it (4 take three times as long):
 * unwind 3
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation cancel-running sc+weak bucket.c: if (st != BT_S_PENDING && st != BT_S_POSTED) return BT_TOO_LATE; => if (st != BT_S_PENDING && st != BT_S_POSTED && st != BT_S_RUNNING) return BT_TOO_LATE;
 * mutation take-unchecked sc port.c: uint64_t expected = BT_WORD(gen, BT_S_POSTED); => uint64_t expected = w;
 * mutation no-generation sc bucket.c: if (BT_WORD_GEN(w) != gen) return BT_UNKNOWN; => (void)gen;
 */
#include "slot.h"

static int cancel_rc, stale_rc;

int main(void) {
    slot_init();
__CPROVER_ASYNC_1:
    timer_thread();
    stale_rc = bt_cancel(&core, id_of(GEN - 1));
    cancel_rc = bt_cancel(&core, id_of(GEN));
    model_join(done_pass);

    __CPROVER_assert(cancel_rc == BT_CANCELLED || cancel_rc == BT_TOO_LATE,
                     "a live id's cancel is answered CANCELLED or TOO_LATE");
    __CPROVER_assert(ran == (cancel_rc == BT_TOO_LATE),
                     "it ran if and only if the cancel was too late");
    __CPROVER_assert(stale_rc == BT_UNKNOWN, "a stale id is unknown");
    __CPROVER_assert(BT_WORD_GEN(slot.word) == GEN, "nobody changed the generation");
    return 0;
}
