/*
 * slot.h -- what the harnesses of one timer's state word share (word.c,
 * postpone.c): the core's real bucket.c, pass.c and port.c, one core with
 * one bucket, and one PENDING port timer in one static slot, due at KEY.
 *
 * bt__slot is the harness's own (the real one walks the slot directory;
 * the word is what is checked here), and so are the reap's slot retirement
 * and the collect request, whose effects nothing here reads.
 *
 * CBMC refuses a program that stores a pointer to memory threads share
 * ("pointer handling for concurrency is unsound"), so in the model copy a
 * reap only counts the slot instead of linking it on its chain (the chain is
 * the pass's own, given back after the pass).  The cancel's "every
 * drain_threshold cancels, ask for a collect" is a 64-bit remainder that
 * costs CBMC more than the protocol does; the request is stubbed anyway.
 *
 * Under SC and PSO, with no mutation that only PSO catches: every
 * property of these harnesses is the outcome of read-modify-writes on one
 * word (fire, take, cancel, postpone, the move), which coherence and the
 * RMWs' atomicity fix under any memory model; what a postpone publishes
 * besides the word (moved_to, then the key) is written and read under the
 * home bucket's mutex.  A step dropped (sc+weak) shows the PSO run can fail.
 *
 * (tools/model_check.py reads these lines in every harness that includes
 * this file.)
 * adapt pass.c: t->next = c->head;\n    c->head = t;\n    if (!c->tail) c->tail = t;\n    c->n++; => c->n++;
 * adapt bucket.c: if (__builtin_expect(n % tt->opt.drain_threshold == 0, 0)) bt__request_collect(tt); => (void)n;
 */
#ifndef BT_MODEL_SLOT_H
#define BT_MODEL_SLOT_H

#include "model.h"

#include "../bucket.c"
#include "../pass.c"
#include "../port.c"

#define TAG 1u
#define GEN 7u
#define KEY 100
#define LATER 150

static bt_timer_thread core;
static struct bt__bucket buckets[1];
static struct reap_chain chains[1];
static struct bt_timer slot;
_Atomic uint64_t bt__fork_generation;

struct bt_timer *bt__slot(bt_timer_thread *tt, uint64_t id) {
    return (uint32_t)id >> BT_INDEX_BITS == tt->tag ? &slot : NULL;
}

int bt__slot_retire(bt_timer_thread *tt, struct bt_timer *t) {
    (void)tt, (void)t;
    return 1;
}

void bt__request_collect(bt_timer_thread *tt) { (void)tt; }

/* The id of the slot's generation gen. */
static uint64_t id_of(uint32_t gen) { return (uint64_t)gen << 32 | TAG << BT_INDEX_BITS; }

static void slot_init(void) {
    core.tag = TAG;
    core.nbuckets = 1;
    core.buckets = buckets;
    core.chains = chains;
    core.opt.drain_threshold = 1000;
    slot.slot = TAG << BT_INDEX_BITS;
    slot.deadline = KEY;
    slot.word = BT_WORD(GEN, BT_S_PENDING);
}

static volatile int done_pass;
static int ran, fired_key;

/* The timer thread and the port's consumer, as one thread: the pass pops
 * the due timer at KEY (a postponed one goes back in the heap and is popped
 * again at its new key); one it fired is the consumer's to run.  fired_key:
 * the key it fired at, or -1; ran: the consumer ran it. */
static void timer_thread(void) {
    enum claim c = claim_due(&core, &slot, 0);
    if (c == CLAIM_MOVED) c = claim_due(&core, &slot, 0);
    fired_key = c == CLAIM_FIRED ? (int)BT_LOAD(slot.deadline) : -1;
    ran = c == CLAIM_FIRED && take_posted(&slot);
    model_done(&done_pass);
}

#endif
