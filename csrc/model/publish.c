/*
 * publish.c -- model check: a timer's fields published through its state
 * word, a schedule against the walk of bt_port_cancel_all and bt_drop_all
 * (docs/design.rst, rules 1 and 2).
 *
 * Property: whoever sees the word PENDING sees the fields the schedule
 * wrote before it.  bt__pool_cancel, the walk under bt_port_cancel_all
 * and bt_drop_all, takes no bucket lock: it reads each slot's word
 * (acquire), then the timer's port and payload, and cancels it with a
 * compare-exchange.  Run against a schedule, it either cancels the new
 * timer and hands its callback the schedule's port and payload, or leaves
 * it PENDING; never a timer with the slot's previous port or payload.
 *
 * Code under test, as it is in csrc/: schedule_timer with
 * push_pending_locked (bucket.c), its release store of the word;
 * bt__pool_cancel (pool.c), its acquire load and compare-exchange, called
 * as bt_drop_all calls it, for every port: bt_port_cancel_all's filter
 * (`p != port`, a pointer read from shared memory compared) is what CBMC's
 * concurrency support gets wrong, finding every timer another port's.
 * Stubbed: the wake (bt__wake_for) and the collect request.  The slot held
 * another timer before (its fields are that timer's, its word FREE at the
 * same generation).
 *
 * The core, its one slot and the schedule's take of it are oneslot.h's.
 * unwind 2
 *
 * Threads and bounds: one schedule against one walk: 2 threads.  The
 * pattern is message passing (fields, then the word; the word, then the
 * fields), which a store-store reordering breaks: PSO shows the release
 * store is needed, and the weak mutation below relaxes it.  PSO never
 * reorders loads, so the acquire on the reader's side is beyond it
 * (docs/design.rst, "Model checks").
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation word-before-fields sc bucket.c: BT_STORE(t->deadline, deadline); => atomic_store(&t->word, BT_WORD(BT_WORD_GEN(atomic_load(&t->word)), BT_S_PENDING));\n    BT_STORE(t->deadline, deadline);
 * mutation pending-relaxed weak bucket.c: atomic_store_explicit(&t->word, BT_WORD(gen, BT_S_PENDING), memory_order_release); => atomic_store_explicit(&t->word, BT_WORD(gen, BT_S_PENDING), memory_order_relaxed);
 */
#include "oneslot.h"

static bt_port earlier_port;
static int payload, earlier_payload;
_Atomic uint64_t bt__fork_generation;
static volatile int done_scheduler;
static int schedule_rc, dropped, dropped_right;
static uint64_t id;

int bt__wake_for(bt_timer_thread *tt, int64_t deadline, int drain) {
    (void)tt, (void)deadline, (void)drain;
    return 0;
}

void bt__request_collect(bt_timer_thread *tt) { (void)tt; }

static void on_drop(void *ctx, bt_port *p, void *arg) {
    (void)ctx;
    dropped++;
    dropped_right = p == &port && arg == &payload;
}

static void scheduler(void) {
    schedule_rc = bt_schedule_port(&core, 100, &port, &payload, &id);
    model_done(&done_scheduler);
}

int main(void) {
    oneslot_init(BT_WORD(GEN, BT_S_FREE));
    earlier_port.tt = &core;
    slot.target = &earlier_port; /* the slot's previous timer, released */
    slot.arg = &earlier_payload;
__CPROVER_ASYNC_1:
    scheduler();
    int64_t n = bt__pool_cancel(&core, NULL, on_drop, NULL);
    model_join(done_scheduler);

    uint64_t w = slot.word;
    __CPROVER_assert(schedule_rc == 0 && n == dropped, "the schedule and the walk succeed");
    if (dropped) {
        __CPROVER_assert(dropped == 1 && dropped_right,
                         "a timer seen PENDING is seen with its own port and payload");
        __CPROVER_assert(w == BT_WORD(GEN, BT_S_CANCELLED), "and is cancelled");
    } else {
        __CPROVER_assert(w == BT_WORD(GEN, BT_S_PENDING), "or left pending");
    }
    return 0;
}
