/*
 * test_core.c -- C-only tests of the core, run by ctest (and under the
 * sanitizers).  Each test is a function; CHECK prints the failing expression
 * and counts it.  Prints "N passed, N failed" at the end.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bucketimer.h"
#include "internal.h" /* white-box tests reach into a slot */

#include "check.h"

#define MS 1000000LL

/* ---- a recorder for native callbacks ----------------------------------- */

#define MAX_REC 100000
struct rec {
    _Atomic size_t n;
    uint64_t ids[MAX_REC];
    int64_t at[MAX_REC];
    int64_t deadline[MAX_REC];
};

struct rec_arg {
    struct rec *rec;
    int64_t deadline;
    int manual;
    bt_timer_thread *tt;
};

static void record(void *arg, uint64_t id) {
    struct rec_arg *a = arg;
    size_t i = atomic_fetch_add(&a->rec->n, 1);
    if (i < MAX_REC) {
        a->rec->ids[i] = id;
        a->rec->at[i] = a->manual ? bt_time_ns(a->tt) : bt_now_ns();
        a->rec->deadline[i] = a->deadline;
    }
}

/* ---- tests ------------------------------------------------------------- */

static void test_manual_order_and_ties(void) {
    bt_timer_thread *tt = manual_core(1000);
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    static struct rec_arg args[6];
    int64_t deadlines[6] = {5000, 3000, 3000, 4000, 3000, 1500};
    uint64_t ids[6];
    for (int i = 0; i < 6; i++) {
        args[i] = (struct rec_arg){&rec, deadlines[i], 1, tt};
        CHECK(bt_schedule_native(tt, deadlines[i], record, &args[i], &ids[i]) == 0);
        CHECK(ids[i] != 0);
    }
    CHECK(bt_next_deadline(tt) == 1500);
    CHECK(bt_advance(tt, 999) == 0);
    CHECK(atomic_load(&rec.n) == 0);
    CHECK(bt_advance(tt, 3000) == 4);
    /* 1500 first, then the three 3000s in schedule order */
    CHECK(rec.ids[0] == ids[5]);
    CHECK(rec.ids[1] == ids[1]);
    CHECK(rec.ids[2] == ids[2]);
    CHECK(rec.ids[3] == ids[4]);
    for (size_t i = 0; i < atomic_load(&rec.n); i++) CHECK(rec.at[i] >= rec.deadline[i]);
    /* three-way cancel */
    CHECK(bt_cancel(tt, ids[3]) == BT_CANCELLED);
    CHECK(bt_cancel(tt, ids[3]) == BT_TOO_LATE);  /* already cancelled */
    CHECK(bt_cancel(tt, ids[1]) == BT_UNKNOWN);   /* ran, slot recycled */
    CHECK(bt_cancel(tt, 0) == BT_UNKNOWN);
    CHECK(bt_cancel(tt, ((uint64_t)77 << 32) | 5) == BT_UNKNOWN);
    CHECK(bt_cancel(tt, 0xffffffffffffffffULL) == BT_UNKNOWN);
    CHECK(bt_advance(tt, 10000) == 1);
    CHECK(rec.ids[4] == ids[0]);
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.scheduled == 6);
    CHECK(s.cancelled == 1);
    CHECK(s.fired == 5);
    CHECK(s.ran == 5);
    CHECK(s.early_fires == 0);
    CHECK(s.heap_size == 0);
    CHECK(s.slots_free == s.slots);
    bt_destroy(tt);
}

static void test_stale_id_after_reuse(void) {
    bt_timer_thread *tt = manual_core(1000);
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    struct rec_arg a = {&rec, 2000, 1, tt};
    uint64_t id1, id2;
    CHECK(bt_schedule_native(tt, 2000, record, &a, &id1) == 0);
    CHECK(bt_advance(tt, 2000) == 1);
    /* the slot is reused by the next schedule on this thread */
    CHECK(bt_schedule_native(tt, 3000, record, &a, &id2) == 0);
    CHECK((uint32_t)id1 == (uint32_t)id2);
    CHECK(id1 != id2);
    CHECK(bt_cancel(tt, id1) == BT_UNKNOWN); /* stale: must not cancel id2 */
    CHECK(bt_advance(tt, 3000) == 1);
    CHECK(atomic_load(&rec.n) == 2);
    bt_destroy(tt);
}

static void test_ports_manual(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p = open_port(tt);
    CHECK(bt_port_fd(p) >= 0);
    uint64_t ids[4];
    for (int i = 0; i < 4; i++)
        CHECK(bt_schedule_port(tt, 2000 + i, p, (void *)(intptr_t)(i + 1), &ids[i]) == 0);
    CHECK(bt_advance(tt, 2002) == 3);
    /* posted but not yet run: a cancel still wins */
    CHECK(bt_cancel(tt, ids[1]) == BT_CANCELLED);
    struct pollfd pfd = {bt_port_fd(p), POLLIN, 0};
    CHECK(poll(&pfd, 1, 0) == 1);
    uint64_t out[8];
    size_t n = bt_port_drain_ids(p, out, 8);
    CHECK(n == 2);
    CHECK(out[0] == ids[0] && out[1] == ids[2]);
    pfd.revents = 0;
    CHECK(poll(&pfd, 1, 0) == 0); /* acked */
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.eventfd_writes == 1); /* one pass, one write */
    CHECK(s.posted == 3);
    /* a detached port never gets signalled; its timers go to the orphans */
    CHECK(bt_port_detach(p) == 0);
    CHECK(bt_port_fd(p) == -1);
    CHECK(bt_advance(tt, 5000) == 1);
    CHECK(bt_port_drain_ids(p, out, 8) == 0);
    CHECK(bt_port_drain_ids(bt_orphans(tt), out, 8) == 1 && out[0] == ids[3]);
    bt_destroy(tt);
}

/* A consumer's poll at 2000, with the core's next seq then: a timer due by
 * then but scheduled after it (an earlier deadline, posted by a later pass)
 * and one due after it are passed over, in their places, for a later pop. */
static void test_port_pop_polled(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p = open_port(tt);
    uint64_t a, late, b;
    CHECK(bt_schedule_port(tt, 1800, p, (void *)1, &a) == 0);
    CHECK(bt_schedule_port(tt, 2500, p, (void *)2, &late) == 0);
    CHECK(bt_advance(tt, 2000) == 1); /* a posted */
    uint64_t seq = bt_port_next_seq(p); /* the poll */
    CHECK(bt_schedule_port(tt, 1500, p, (void *)3, &b) == 0);
    CHECK(bt_advance(tt, 2600) == 2); /* b and late posted */
    bt_timer *t = bt_port_pop_polled(p, 2000, seq);
    CHECK(t && bt_timer_id(t) == a);
    if (t) {
        CHECK(bt_timer_claim(p, t) == 1);
        bt_timer_release(p, t);
    }
    CHECK(bt_port_pop_polled(p, 2000, seq) == NULL);
    CHECK(bt_port_has_posted(p));
    /* the next poll: both, in deadline order */
    uint64_t out[4];
    CHECK(bt_port_drain_ids(p, out, 4) == 2);
    CHECK(out[0] == b && out[1] == late);
    bt_destroy(tt);
}

/* What a native callback sees of the counters: itself counted as fired,
 * and a port timer of the same pass counted as posted and already on its
 * port.  (They were bumped after the whole pass, after the ports were
 * signalled, so a consumer could run a timer that stats() did not show.) */
struct seen {
    bt_timer_thread *tt;
    bt_port *port;
    uint64_t fired, posted;
    size_t on_port;
};

static void look(void *arg, uint64_t id) {
    (void)id;
    struct seen *w = arg;
    bt_stats s;
    bt_get_stats(w->tt, &s);
    w->fired = s.fired;
    w->posted = s.posted;
    uint64_t out[4];
    w->on_port = bt_port_drain_ids(w->port, out, 4);
}

static void test_counters_before_delivery(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p = open_port(tt);
    struct seen w = {tt, p, 0, 0, 0};
    uint64_t a, b;
    CHECK(bt_schedule_port(tt, 2000, p, (void *)1, &a) == 0);
    CHECK(bt_schedule_native(tt, 2001, look, &w, &b) == 0);
    CHECK(bt_advance(tt, 3000) == 2);
    CHECK(w.fired == 2);   /* the port timer and itself */
    CHECK(w.posted == 1);
    CHECK(w.on_port == 1); /* handed over before the native callback ran */
    bt_destroy(tt);
}

static void test_bad_input(void) {
    bt_timer_thread *tt = manual_core(1000);
    uint64_t id;
    CHECK(bt_schedule_native(tt, 1, NULL, NULL, &id) == -EINVAL);
    CHECK(bt_schedule_port(tt, 1, NULL, NULL, &id) == -EINVAL);
    bt_timer_thread *other = manual_core(1000);
    bt_port *foreign;
    CHECK(bt_port_open(other, 0, &foreign) == 0);
    CHECK(bt_schedule_port(tt, 1, foreign, NULL, &id) == -EINVAL);
    bt_options o;
    bt_options_init(&o);
    o.num_buckets = 100000;
    bt_timer_thread *bad = NULL;
    CHECK(bt_create(&o, &bad) == -EINVAL && bad == NULL);
    bt_timer_thread *real = threaded_core();
    CHECK(bt_advance(real, 5) == -EINVAL);
    bt_destroy(real);
    bt_destroy(other);
    bt_destroy(tt);
}

static void test_garbage_bounded(void) {
    /* A million schedule+cancel pairs of far-away timers: bucket lists are
     * drained at the threshold and the heap never holds the dead. */
    bt_timer_thread *tt = threaded_core();
    static struct rec rec;
    struct rec_arg a = {&rec, 0, 0, tt};
    int64_t far = bt_now_ns() + 3600LL * 1000 * MS;
    uint64_t max_list = 0, max_slots = 0;
    for (int i = 0; i < 1000000; i++) {
        uint64_t id;
        CHECK(bt_schedule_native(tt, far + i, record, &a, &id) == 0);
        CHECK(bt_cancel(tt, id) == BT_CANCELLED);
        if ((i & 8191) == 0) {
            bt_stats s;
            bt_get_stats(tt, &s);
            if (s.list_size > max_list) max_list = s.list_size;
            if (s.slots > max_slots) max_slots = s.slots;
        }
    }
    usleep(20000);
    bt_stats s;
    bt_get_stats(tt, &s);
    printf("  garbage: max list %llu, slots %llu, drains %llu, wakeups %llu, heap %llu\n",
           (unsigned long long)max_list, (unsigned long long)s.slots,
           (unsigned long long)s.drains, (unsigned long long)s.wakeups,
           (unsigned long long)s.heap_size);
    CHECK(max_list <= 2 * BT_DEFAULT_DRAIN_THRESHOLD);
    CHECK(s.slots <= 64 * 1024);
    CHECK(s.heap_size <= BT_DEFAULT_SWEEP_MIN);
    CHECK(s.wakeups < 1000);
    bt_destroy(tt);
}

static void test_heap_sweep(void) {
    /* Live timers that reach the heap and are cancelled there get swept. */
    bt_timer_thread *tt = manual_core(1000);
    static struct rec rec;
    struct rec_arg a = {&rec, 0, 1, tt};
    enum { N = 20000 };
    static uint64_t ids[N];
    for (int i = 0; i < N; i++) CHECK(bt_schedule_native(tt, 1000000 + i, record, &a, &ids[i]) == 0);
    CHECK(bt_advance(tt, 1001) == 0); /* collects into the heap */
    for (int i = 0; i < N; i++) CHECK(bt_cancel(tt, ids[i]) == BT_CANCELLED);
    uint64_t id;
    CHECK(bt_schedule_native(tt, 1000000, record, &a, &id) == 0);
    CHECK(bt_advance(tt, 1002) == 0);
    bt_stats s;
    bt_get_stats(tt, &s);
    /* Every BT_DEFAULT_DRAIN_THRESHOLD-th cancel asks for a collect; sweeps
     * ran when the dead were more than half of a heap of at least
     * BT_DEFAULT_SWEEP_MIN: what is left is less. */
    CHECK(s.sweeps >= 1);
    CHECK(s.heap_size < BT_DEFAULT_SWEEP_MIN);
    CHECK(s.dead + 1 == s.heap_size); /* all dead but the new timer */
    bt_destroy(tt);
}

static void test_real_thread_fires_on_time(void) {
    bt_timer_thread *tt = threaded_core();
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    enum { N = 2000 };
    static struct rec_arg args[N];
    static uint64_t ids[N];
    int64_t now = bt_now_ns();
    unsigned seed = 12345;
    int cancelled = 0;
    for (int i = 0; i < N; i++) {
        int64_t d = now + (int64_t)(rand_r(&seed) % 50) * MS + (rand_r(&seed) % 1000);
        args[i] = (struct rec_arg){&rec, d, 0, tt};
        CHECK(bt_schedule_native(tt, d, record, &args[i], &ids[i]) == 0);
    }
    for (int i = 0; i < N; i += 3)
        if (bt_cancel(tt, ids[i]) == BT_CANCELLED) cancelled++;
    usleep(120000);
    bt_stop(tt); /* joins the thread: its writes to rec happen-before ours */
    size_t n = atomic_load(&rec.n);
    CHECK(n == (size_t)(N - cancelled));
    int early = 0;
    for (size_t i = 0; i < n && i < MAX_REC; i++)
        if (rec.at[i] < rec.deadline[i]) early++;
    CHECK(early == 0);
    /* each id at most once */
    for (size_t i = 1; i < n; i++)
        for (size_t j = 0; j < i && j < 64; j++) CHECK(rec.ids[i] != rec.ids[i - 1 - j % i]);
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.early_fires == 0);
    CHECK(s.ran == n);
    bt_destroy(tt);
}

/* The timer thread maps the pool's first block as it starts: the first
 * schedule takes it rather than mapping one; a core destroyed before any
 * schedule unmaps it. */
static struct bt_timer *wait_for_spare(bt_timer_thread *tt) {
    struct bt_timer *spare = NULL;
    for (int i = 0; i < 5000 && !(spare = atomic_load(&tt->spare)); i++) usleep(1000);
    return spare;
}

static void test_first_block_comes_ready(void) {
    bt_timer_thread *tt = threaded_core();
    struct bt_timer *spare = wait_for_spare(tt);
    CHECK(spare != NULL);
    CHECK(atomic_load(&tt->nblocks) == 0);
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    struct rec_arg arg = {&rec, bt_now_ns() + 10000 * MS, 0, tt};
    uint64_t id;
    CHECK(bt_schedule_native(tt, arg.deadline, record, &arg, &id) == 0);
    CHECK(atomic_load(&tt->spare) == NULL);
    CHECK(atomic_load(&tt->nblocks) == 1);
    CHECK(atomic_load(&tt->blocks[0]) == spare);
    CHECK(bt_cancel(tt, id) == BT_CANCELLED);
    bt_stop(tt);
    bt_destroy(tt);

    tt = threaded_core();
    CHECK(wait_for_spare(tt) != NULL);
    bt_stop(tt);
    bt_destroy(tt); /* (and unmaps the spare it never handed out) */
}

static void test_wake_for_earlier(void) {
    /* A far timer first, then a near one: the near one must wake the thread. */
    bt_timer_thread *tt = threaded_core();
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    struct rec_arg far = {&rec, bt_now_ns() + 10000 * MS, 0, tt};
    uint64_t id;
    CHECK(bt_schedule_native(tt, far.deadline, record, &far, &id) == 0);
    usleep(5000);
    struct rec_arg near = {&rec, bt_now_ns() + 2 * MS, 0, tt};
    CHECK(bt_schedule_native(tt, near.deadline, record, &near, &id) == 0);
    usleep(30000);
    bt_stop(tt);
    CHECK(atomic_load(&rec.n) == 1);
    bt_destroy(tt);
}

static _Atomic int dropped_count;
static void on_drop(void *ctx, bt_port *port, void *payload) {
    (void)ctx;
    (void)port;
    (void)payload;
    atomic_fetch_add(&dropped_count, 1);
}

static void test_stop_drops_pending(void) {
    bt_timer_thread *tt = threaded_core();
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    struct rec_arg a = {&rec, 0, 0, tt};
    bt_port *p = open_port(tt);
    uint64_t id;
    for (int i = 0; i < 100; i++)
        CHECK(bt_schedule_native(tt, bt_now_ns() + 1000 * MS, record, &a, &id) == 0);
    CHECK(bt_schedule_port(tt, bt_now_ns() + 1000 * MS, p, NULL, &id) == 0);
    CHECK(bt_drop_all(tt, on_drop, NULL) == -EBUSY);
    CHECK(bt_stop(tt) == 0);
    CHECK(bt_stop(tt) == 0);
    CHECK(bt_is_stopped(tt));
    CHECK(bt_schedule_native(tt, 0, record, &a, &id) == -ESHUTDOWN);
    CHECK(bt_drop_all(tt, on_drop, NULL) == 101);
    CHECK(atomic_load(&dropped_count) == 101);
    CHECK(bt_cancel(tt, id) == BT_TOO_LATE);
    CHECK(atomic_load(&rec.n) == 0);
    bt_destroy(tt);
}

/* An id names its core: a core answers BT_UNKNOWN for another core's ids and
 * its own timers are untouched.  (Ids of an earlier core were
 * `generation << 32 | slot` with every core's generations starting at 1, so
 * the first timer of every thread on every core had the same id.)  Checked
 * across 63 cores alive at once, each cancelling every other's first id, and
 * with slots reused on both sides. */
#define NCORES 63
static void test_ids_carry_their_core(void) {
    static bt_timer_thread *cores[NCORES];
    static uint64_t first[NCORES];
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    static struct rec_arg args[NCORES];
    for (int i = 0; i < NCORES; i++) {
        cores[i] = manual_core(1000);
        args[i] = (struct rec_arg){&rec, 5000, 1, cores[i]};
        CHECK(bt_schedule_native(cores[i], 5000, record, &args[i], &first[i]) == 0);
    }
    int same = 0, foreign_won = 0;
    for (int i = 0; i < NCORES; i++)
        for (int j = 0; j < NCORES; j++) {
            if (i == j) continue;
            if (first[i] == first[j]) same++;
            if (bt_cancel(cores[i], first[j]) != BT_UNKNOWN) foreign_won++;
        }
    CHECK(same == 0);
    CHECK(foreign_won == 0);
    /* Every core still has its own timer, and it fires. */
    for (int i = 0; i < NCORES; i++) CHECK(bt_advance(cores[i], 5000) == 1);
    CHECK(atomic_load(&rec.n) == NCORES);
    /* Slots reused: the second timer of each core takes the slot of its
     * first; ids still differ across cores and foreign cancels still miss. */
    uint64_t second[2];
    for (int i = 0; i < 2; i++)
        CHECK(bt_schedule_native(cores[i], 6000, record, &args[i], &second[i]) == 0);
    CHECK(second[0] != second[1]);
    CHECK(bt_cancel(cores[0], second[1]) == BT_UNKNOWN);
    CHECK(bt_cancel(cores[1], second[0]) == BT_UNKNOWN);
    CHECK(bt_cancel(cores[0], second[0]) == BT_CANCELLED);
    CHECK(bt_cancel(cores[1], second[1]) == BT_CANCELLED);
    printf("  ids of %d live cores: %d equal pairs, %d foreign cancels that did not answer "
           "BT_UNKNOWN\n", NCORES, same / 2, foreign_won);
    for (int i = 0; i < NCORES; i++) bt_destroy(cores[i]);
}

/* Ids never repeat while the core lives, not even after a slot's 32-bit
 * generation has gone all the way round.  White-box: the slot of a finished
 * timer is set to two generations before the one it started at, as if it had
 * been reused 2^32 - 2 times, and then reused (the free list is LIFO, so the
 * next timer of this thread takes it) until a timer lands elsewhere.  The
 * first id must never be issued again, nor cancel a later timer.  The slot
 * is given back by each of the three owners that finish a timer: the pass
 * after a native callback, a port's consumer, the reaping of a cancelled
 * timer.  (An earlier core wrapped the generation and reused the slot: its
 * next id was the first one again, and the stale first id cancelled the new
 * timer.) */
enum finish { BY_NATIVE, BY_PORT, BY_CANCEL };

/* Schedules one timer and finishes it `how`.  While it is live, a cancel
 * with `stale` (0: none) must not touch it; *stale_won counts those that did. */
static void finish_one(bt_timer_thread *tt, bt_port *p, enum finish how, int64_t at,
                       struct rec_arg *a, uint64_t *id, uint64_t stale, int *stale_won) {
    uint64_t out[2];
    if (how == BY_PORT) CHECK(bt_schedule_port(tt, at, p, NULL, id) == 0);
    else CHECK(bt_schedule_native(tt, at, record, a, id) == 0);
    if (stale && bt_cancel(tt, stale) != BT_UNKNOWN) (*stale_won)++;
    if (how == BY_CANCEL) CHECK(bt_cancel(tt, *id) == BT_CANCELLED);
    bt_advance(tt, at); /* fires it, or reaps it */
    if (how == BY_PORT) CHECK(bt_port_drain_ids(p, out, 2) == 1);
}

static void generation_wrap(enum finish how) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p;
    CHECK(bt_port_open(tt, 0, &p) == 0);
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    struct rec_arg a = {&rec, 0, 1, tt};
    uint64_t first, id;
    int repeats = 0, stale_won = 0, same_slot = 0;
    finish_one(tt, p, how, 2000, &a, &first, 0, &stale_won);
    struct bt_timer *t = bt__slot(tt, first);
    CHECK(t != NULL);
    uint32_t gen0 = (uint32_t)(first >> 32);
    CHECK(BT_WORD_STATE(atomic_load(&t->word)) == BT_S_FREE);
    atomic_store(&t->word, BT_WORD(gen0 - 2, BT_S_FREE));
    for (int64_t k = 1; k <= 4; k++) {
        finish_one(tt, p, how, 2000 + k, &a, &id, first, &stale_won);
        if (id == first) repeats++;
        if ((uint32_t)id == (uint32_t)first) same_slot++;
    }
    printf("  generation wrap (%s): the slot served %d more timers, %d repeated the first id, "
           "the stale first id cancelled %d\n",
           how == BY_NATIVE ? "native" : how == BY_PORT ? "port" : "cancelled", same_slot,
           repeats, stale_won);
    CHECK(repeats == 0);
    CHECK(stale_won == 0);
    CHECK(same_slot == 2); /* generations gen0 - 2 and gen0 - 1, then retired */
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.slots_retired == 1);
    CHECK(s.slots_free + s.slots_retired == s.slots);
    CHECK(s.dead == 0);
    /* Retired: FREE with the generation it started at, on no free list. */
    CHECK(atomic_load(&t->word) == BT_WORD(gen0, BT_S_FREE));
    bt_destroy(tt);
}

static void test_generation_wrap_never_repeats_an_id(void) {
    generation_wrap(BY_NATIVE);
    generation_wrap(BY_PORT);
    generation_wrap(BY_CANCEL);
}

/* ---- stop and destroy, concurrent and from a native callback ---------- */

struct slow_cb {
    _Atomic int started, done;
};

static void slow(void *arg, uint64_t id) {
    (void)id;
    struct slow_cb *c = arg;
    atomic_store(&c->started, 1);
    usleep(100000);
    atomic_store(&c->done, 1);
}

static void *stop_core(void *arg) {
    bt_stop(arg);
    return NULL;
}

/* Two threads call bt_stop while a native callback runs: each returns only
 * once the thread is joined (the callback is over), not only the first.  (An
 * earlier core's second caller saw the flag already set and returned at once,
 * before the bucket fence and the join: its bt_drop_all could miss a schedule
 * in flight, and a bt_destroy after it freed memory the thread still used.) */
static void test_second_concurrent_stop_waits_for_the_join(void) {
    bt_timer_thread *tt = threaded_core();
    struct slow_cb c = {0, 0};
    uint64_t id;
    CHECK(bt_schedule_native(tt, bt_now_ns(), slow, &c, &id) == 0);
    while (!atomic_load(&c.started)) usleep(1000);
    pthread_t first;
    CHECK(pthread_create(&first, NULL, stop_core, tt) == 0);
    while (!bt_is_stopped(tt)) usleep(100); /* the first bt_stop is under way */
    CHECK(bt_stop(tt) == 0);
    int done = atomic_load(&c.done);
    printf("  second bt_stop returned %s the callback finished\n", done ? "after" : "BEFORE");
    CHECK(done == 1);
    pthread_join(first, NULL);
    bt_destroy(tt);
}

struct stopper {
    bt_timer_thread *tt;
    int destroy;
    _Atomic int rc, calls;
    _Atomic int others_done; /* nobody else uses tt any more (bt_destroy's contract) */
};

static void stop_self(void *arg, uint64_t id) {
    (void)id;
    struct stopper *s = arg;
    atomic_fetch_add(&s->calls, 1);
    if (s->destroy) {
        while (!atomic_load(&s->others_done)) usleep(100);
        bt_destroy(s->tt);
    } else {
        atomic_store(&s->rc, bt_stop(s->tt));
        uint64_t again;
        /* Stopped: a schedule from the same callback is refused. */
        if (bt_schedule_native(s->tt, 0, stop_self, s, &again) != -ESHUTDOWN)
            atomic_fetch_add(&s->calls, 100);
    }
}

/* bt_stop from a native callback: the timer thread cannot join itself.  It
 * marks the core stopped and returns 0 at once; no other timer runs after
 * that callback (the rest of its pass is skipped, so a timer due at the same
 * instant is left for bt_drop_all); a later bt_stop from another thread
 * joins the thread.  (An earlier core called pthread_join on itself, ignored
 * EDEADLK, and went on firing the rest of the pass.) */
static void test_stop_from_a_native_callback(void) {
    bt_timer_thread *tt = threaded_core();
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    struct stopper st = {tt, 0, -1, 0, 1};
    /* far enough for both schedules to land first, even under TSan */
    int64_t at = bt_now_ns() + 100 * MS;
    struct rec_arg a = {&rec, at, 0, tt};
    uint64_t id;
    CHECK(bt_schedule_native(tt, at, stop_self, &st, &id) == 0);
    CHECK(bt_schedule_native(tt, at, record, &a, &id) == 0); /* same instant, after it */
    while (!atomic_load(&st.calls)) usleep(1000);
    usleep(20000);
    CHECK(atomic_load(&st.rc) == 0);
    CHECK(atomic_load(&st.calls) == 1);
    CHECK(bt_is_stopped(tt));
    size_t ran_after = atomic_load(&rec.n);
    printf("  bt_stop from a native callback: %zu timer(s) ran after it on the timer thread\n",
           ran_after);
    CHECK(ran_after == 0);
    CHECK(bt_drop_all(tt, NULL, NULL) == 1);
    CHECK(bt_stop(tt) == 0); /* joins */
    bt_destroy(tt);
}

/* bt_destroy from a native callback must not free what the pass still uses:
 * the core is stopped, and the timer thread frees it once the callback has
 * returned, then exits.  (An earlier core freed it there and then, and the
 * pass went on in freed memory: ASan reports a heap-use-after-free.) */
static void test_destroy_from_a_native_callback(void) {
    int before = thread_count();
    bt_timer_thread *tt = threaded_core();
    bt_port *p = open_port(tt);
    /* Static: the timer thread's last read of it is ordered with nothing
     * the test can wait on (it detaches and exits), so its stack frame must
     * not be reused by the tests that follow. */
    static struct stopper st;
    st.tt = tt;
    st.destroy = 1;
    atomic_store(&st.rc, -1);
    atomic_store(&st.calls, 0);
    atomic_store(&st.others_done, 0);
    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    /* Scheduled well before they fall due: tt must not be used after. */
    int64_t at = bt_now_ns() + 50 * MS;
    struct rec_arg a = {&rec, at, 0, tt};
    uint64_t id;
    CHECK(bt_schedule_native(tt, at + 1000 * MS, record, &a, &id) == 0);
    CHECK(bt_schedule_port(tt, at, p, NULL, &id) == 0);
    CHECK(bt_schedule_native(tt, at, stop_self, &st, &id) == 0);
    CHECK(bt_schedule_native(tt, at, record, &a, &id) == 0);
    atomic_store(&st.others_done, 1);
    int64_t end = bt_now_ns() + 2000 * MS;
    while (thread_count() > before && bt_now_ns() < end) usleep(1000);
    CHECK(atomic_load(&st.calls) == 1);
    CHECK(atomic_load(&rec.n) == 0);
    CHECK(thread_count() == before); /* the timer thread freed the core and exited */
}

/* The same two calls from a native callback inside bt_advance (manual
 * clock): a stop ends the pass after that callback and later advances are
 * refused; a destroy is carried out when bt_advance returns, not under its
 * pass (ASan: a heap-use-after-free otherwise). */
static void test_stop_and_destroy_inside_advance(void) {
    for (int destroy = 0; destroy <= 1; destroy++) {
        bt_timer_thread *tt = manual_core(1000);
        static struct rec rec;
        memset(&rec, 0, sizeof(rec));
        struct stopper st = {tt, destroy, -1, 0, 1};
        struct rec_arg a = {&rec, 2000, 1, tt};
        uint64_t id;
        CHECK(bt_schedule_native(tt, 2000, stop_self, &st, &id) == 0);
        CHECK(bt_schedule_native(tt, 2000, record, &a, &id) == 0); /* same instant, after */
        CHECK(bt_advance(tt, 2000) == 1);
        CHECK(atomic_load(&st.calls) == 1);
        CHECK(atomic_load(&rec.n) == 0);
        printf("  %s inside bt_advance: %zu timer(s) ran after it\n",
               destroy ? "bt_destroy" : "bt_stop", (size_t)atomic_load(&rec.n));
        if (destroy) continue; /* tt is gone */
        CHECK(atomic_load(&st.rc) == 0);
        CHECK(bt_is_stopped(tt));
        CHECK(bt_advance(tt, 3000) == -ESHUTDOWN);
        CHECK(bt_drop_all(tt, NULL, NULL) == 1);
        bt_destroy(tt);
    }
}

/* After fork() a child has none of the parent's threads, so a lock one of
 * them held at the fork stays held.  Every call on a core inherited that way
 * must refuse without touching a lock.  White-box: the parent holds the
 * core's pass, ports, wake, stop and bucket mutexes across the fork (as other
 * threads might: stats() holds the ports mutex with the GIL released); the
 * child calls everything, under an alarm.  (An earlier core's bt_port_open
 * took the ports mutex in the child and hung.) */
static void test_fork_child_touches_no_lock_of_an_inherited_core(void) {
    bt_timer_thread *tt = threaded_core();
    bt_port *p = open_port(tt);
    uint64_t id;
    CHECK(bt_schedule_port(tt, bt_now_ns(), p, NULL, &id) == 0);
    bt_stats s;
    int64_t end = bt_now_ns() + 2000 * MS;
    do {
        usleep(1000);
        bt_get_stats(tt, &s);
    } while (s.posted < 1 && bt_now_ns() < end);
    bt_timer *popped = NULL;
    bt_port_ack(p);
    popped = bt_port_pop(p); /* a consumer holds it across the fork */
    CHECK(popped != NULL);
    pthread_mutex_lock(&tt->pass_mutex); /* a consumer's pass in progress */
    pthread_mutex_lock(&tt->ports_mutex);
    pthread_mutex_lock(&tt->wake_mutex);
    pthread_mutex_lock(&tt->stop_mutex);
    for (uint32_t b = 0; b < tt->nbuckets; b++) pthread_mutex_lock(&tt->buckets[b].mutex);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(5); /* a hang ends the child with SIGALRM */
        bt_port *q;
        int bad = 0;
        bad |= bt_port_open(tt, 1, &q) != -ECHILD;
        bad |= bt_schedule_native(tt, 0, record, NULL, &id) != -ECHILD;
        bad |= bt_schedule_port(tt, 0, p, NULL, &id) != -ECHILD;
        bad |= bt_cancel(tt, id) != BT_UNKNOWN;
        bad |= bt_next_deadline(tt) != INT64_MAX;
        bad |= bt_deliver_due(tt) != -ECHILD;
        bad |= bt_port_deliver_due(p, INT64_MAX, 1) != -ECHILD;
        bad |= !bt_is_stopped(tt);
        bt_get_stats(tt, &s);
        bad |= s.ports != 0;
        bad |= bt_port_detach(p) != -ECHILD;
        bt_port_ack(p);
        bt_port_signal(p);
        bad |= bt_port_pop(p) != NULL;
        uint64_t ids[4];
        bad |= bt_port_drain_ids(p, ids, 4) != 0;
        bt_timer_release(p, popped);
        bad |= bt_stop(tt) != 0;
        bad |= bt_drop_all(tt, NULL, NULL) != 0;
        bt_destroy(tt);
        _exit(bad ? 3 : 0);
    }
    for (uint32_t b = tt->nbuckets; b-- > 0;) pthread_mutex_unlock(&tt->buckets[b].mutex);
    pthread_mutex_unlock(&tt->stop_mutex);
    pthread_mutex_unlock(&tt->wake_mutex);
    pthread_mutex_unlock(&tt->ports_mutex);
    pthread_mutex_unlock(&tt->pass_mutex);
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    int hung = WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM;
    printf("  child of a fork with the core's locks held: %s\n",
           hung ? "HUNG" : WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "ok" : "wrong answers");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (popped) {
        CHECK(bt_timer_claim(p, popped) == 1);
        bt_timer_release(p, popped);
    }
    bt_destroy(tt);
}

/* The consumer side of a port must never hold up the timer thread.  A
 * consumer stuck inside bt_port_ack's read() -- the port's fd is made
 * blocking here, which stands for a consumer descheduled in the middle of
 * its ack for as long as one likes -- must delay no timer: not the timer of
 * its own port whose signal it waits for, not a native timer, not another
 * port's.  (An earlier core held a per-port mutex across that read() and
 * took the same mutex on the timer thread to signal the port.) */
static void *ack_port(void *arg) {
    bt_port_ack(arg);
    return NULL;
}

static void test_consumer_stuck_in_ack_delays_no_timer(void) {
    bt_timer_thread *tt = threaded_core();
    bt_port *stuck, *other;
    CHECK(bt_port_open(tt, 1, &stuck) == 0);
    CHECK(bt_port_open(tt, 1, &other) == 0);
    int fd = bt_port_fd(stuck);
    CHECK(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0);
    pthread_t consumer;
    CHECK(pthread_create(&consumer, NULL, ack_port, stuck) == 0);
    usleep(20000); /* it is in read(): nothing was signalled yet */

    static struct rec rec;
    memset(&rec, 0, sizeof(rec));
    int64_t now = bt_now_ns();
    struct rec_arg a = {&rec, now + 20 * MS, 0, tt};
    uint64_t id;
    CHECK(bt_schedule_port(tt, now + 5 * MS, stuck, NULL, &id) == 0);
    CHECK(bt_schedule_native(tt, a.deadline, record, &a, &id) == 0);
    CHECK(bt_schedule_port(tt, a.deadline, other, NULL, &id) == 0);
    struct pollfd pfd = {bt_port_fd(other), POLLIN, 0};
    CHECK(poll(&pfd, 1, 1000) == 1); /* the other port's timer was posted */
    int64_t posted_at = bt_now_ns();
    usleep(5000);
    size_t ran = atomic_load(&rec.n); /* the native timer ran meanwhile */

    /* Free the consumer whatever happened: a write is what its read waits for. */
    uint64_t one = 1;
    CHECK(write(fd, &one, sizeof(one)) == (ssize_t)sizeof(one));
    pthread_join(consumer, NULL);
    bt_stop(tt); /* joins the thread: its writes to rec happen-before ours */
    CHECK(ran == 1);
    if (ran == 1) CHECK(rec.at[0] - a.deadline < 100 * MS);
    CHECK(posted_at - a.deadline < 100 * MS);
    printf("  a consumer stuck in read(): the native timer %s, the other port's was posted "
           "%.1f ms late\n", ran ? "ran" : "did NOT run", (double)(posted_at - a.deadline) / MS);
    bt_destroy(tt);
}

int main(void) {
    struct test tests[] = {
        {"manual_order_and_ties", test_manual_order_and_ties},
        {"stale_id_after_reuse", test_stale_id_after_reuse},
        {"ports_manual", test_ports_manual},
        {"port_pop_polled", test_port_pop_polled},
        {"counters_before_delivery", test_counters_before_delivery},
        {"bad_input", test_bad_input},
        {"garbage_bounded", test_garbage_bounded},
        {"heap_sweep", test_heap_sweep},
        {"real_thread_fires_on_time", test_real_thread_fires_on_time},
        {"first_block_comes_ready", test_first_block_comes_ready},
        {"wake_for_earlier", test_wake_for_earlier},
        {"stop_drops_pending", test_stop_drops_pending},
        {"consumer_stuck_in_ack_delays_no_timer", test_consumer_stuck_in_ack_delays_no_timer},
        {"ids_carry_their_core", test_ids_carry_their_core},
        {"generation_wrap_never_repeats_an_id", test_generation_wrap_never_repeats_an_id},
        {"second_concurrent_stop_waits_for_the_join",
         test_second_concurrent_stop_waits_for_the_join},
        {"stop_from_a_native_callback", test_stop_from_a_native_callback},
        {"destroy_from_a_native_callback", test_destroy_from_a_native_callback},
        {"stop_and_destroy_inside_advance", test_stop_and_destroy_inside_advance},
        {"fork_child_touches_no_lock_of_an_inherited_core",
         test_fork_child_touches_no_lock_of_an_inherited_core},
    };
    return RUN_TESTS(tests);
}
