/*
 * test_order.c -- the order in which timers fire (docs/design.rst rule 7),
 * pinned down where it depends on an interleaving.
 *
 * Built with -Wl,--wrap=pthread_mutex_lock (CMakeLists.txt): every mutex
 * lock in this program and in the core library it links goes through
 * __wrap_pthread_mutex_lock below, which can stop the timer thread right
 * before it takes a given bucket's lock and let the test's threads act
 * there.  That makes "a schedule lands while the timer thread is half-way
 * through collecting the bucket lists" deterministic instead of rare.
 *
 * Prints one line per test and "N passed, N failed".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketimer.h"
#include "internal.h" /* white-box: a slot's home bucket, a bucket's mutex */

#include "check.h"

#define MS 1000000LL

/* ---- the lock hook ------------------------------------------------------ */

int __real_pthread_mutex_lock(pthread_mutex_t *m);

static _Thread_local int test_thread; /* main and the workers: never hooked */
static pthread_mutex_t *_Atomic hook_mutex;
static void (*hook_fn)(void);

/* The first time a thread other than the test's own locks hook_mutex, runs
 * hook_fn there first. */
int __wrap_pthread_mutex_lock(pthread_mutex_t *m) {
    if (!test_thread && m == atomic_load(&hook_mutex) &&
        atomic_exchange(&hook_mutex, NULL) == m)
        hook_fn();
    return __real_pthread_mutex_lock(m);
}

/* ---- helpers -------------------------------------------------------------- */

#define MAX_ORDER 200000
static _Atomic size_t nfired;
static uintptr_t order[MAX_ORDER];

static void note(void *arg, uint64_t id) {
    (void)id;
    size_t i = atomic_fetch_add(&nfired, 1);
    if (i < MAX_ORDER) order[i] = (uintptr_t)arg;
}

static long position(uintptr_t what) {
    size_t n = atomic_load(&nfired);
    for (size_t i = 0; i < n && i < MAX_ORDER; i++)
        if (order[i] == what) return (long)i;
    return -1;
}

static int wait_flag(_Atomic int *flag, int64_t timeout_ns) {
    int64_t end = bt_now_ns() + timeout_ns;
    while (!atomic_load(flag)) {
        if (bt_now_ns() > end) return 0;
        usleep(100);
    }
    return 1;
}

/* ---- FIFO across buckets ---------------------------------------------------- */

/* Two threads whose timers live in different buckets.  Thread A schedules a
 * timer, then (happens-before, through a flag) thread B schedules one with
 * the same deadline, already due.  Both land while the timer thread collects
 * the bucket lists: after it passed A's bucket, before it reaches B's.  A
 * was scheduled first, so A must fire first.  (An earlier core locked the
 * buckets one at a time: it took B's timer into this pass and fired it,
 * and found A's only in the next pass.) */

enum { A_LABEL = 1, B_LABEL = 2, TRIGGER = 3 };

static struct {
    bt_timer_thread *tt;
    int64_t deadline;
    _Atomic int go_a, a_done, b_done, quit;
    _Atomic int want_bucket, bucket_a, bucket_b; /* -1 until known */
} F;

static int home_bucket(void) {
    uint64_t id;
    CHECK(bt_schedule_native(F.tt, bt_now_ns() + 3600 * 1000 * MS, note, NULL, &id) == 0);
    int b = (int)bt__slot(F.tt, id)->bucket;
    CHECK(bt_cancel(F.tt, id) == BT_CANCELLED);
    return b;
}

static void *thread_a(void *arg) {
    (void)arg;
    test_thread = 1;
    atomic_store(&F.bucket_a, home_bucket());
    if (!wait_flag(&F.go_a, 5000 * MS)) return NULL;
    uint64_t id;
    CHECK(bt_schedule_native(F.tt, F.deadline, note, (void *)A_LABEL, &id) == 0);
    atomic_store(&F.a_done, 1);
    return NULL;
}

static void *thread_b(void *arg) {
    (void)arg;
    test_thread = 1;
    atomic_store(&F.bucket_b, home_bucket());
    if (!wait_flag(&F.a_done, 5000 * MS)) return NULL; /* A's schedule returned */
    uint64_t id;
    CHECK(bt_schedule_native(F.tt, F.deadline, note, (void *)B_LABEL, &id) == 0);
    atomic_store(&F.b_done, 1);
    return NULL;
}

/* Runs on the timer thread, right before it locks B's bucket in a collect. */
static void between_the_buckets(void) {
    atomic_store(&F.go_a, 1);
    /* A core that holds every bucket lock while it collects blocks A (and so
     * B) until the collect is over: give up waiting then. */
    wait_flag(&F.b_done, 200 * MS);
}

static void test_fifo_across_buckets(void) {
    memset(&F, 0, sizeof(F));
    atomic_store(&nfired, 0);
    CHECK(bt_create(NULL, &F.tt) == 0);
    /* Threads get buckets round robin in creation order; the one with the
     * lower bucket plays A (the collect passes it first). */
    pthread_t t1, t2;
    atomic_store(&F.bucket_a, -1);
    atomic_store(&F.bucket_b, -1);
    CHECK(pthread_create(&t1, NULL, thread_a, NULL) == 0);
    while (atomic_load(&F.bucket_a) < 0) usleep(100);
    CHECK(pthread_create(&t2, NULL, thread_b, NULL) == 0);
    while (atomic_load(&F.bucket_b) < 0) usleep(100);
    int ba = atomic_load(&F.bucket_a), bb = atomic_load(&F.bucket_b);
    CHECK(ba != bb);
    if (ba > bb) {
        /* Swap roles: B must be the one in the higher bucket.  Cheapest to
         * start over with the threads the other way round. */
        atomic_store(&F.go_a, 1);
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
        bt_destroy(F.tt);
        static int retries;
        if (retries++ < 16) {
            test_fifo_across_buckets();
            return;
        }
        CHECK(!"could not get A's bucket below B's");
        return;
    }
    F.deadline = bt_now_ns(); /* due already */
    hook_fn = between_the_buckets;
    atomic_store(&hook_mutex, &F.tt->buckets[bb].mutex);
    uint64_t id;
    CHECK(bt_schedule_native(F.tt, bt_now_ns(), note, (void *)TRIGGER, &id) == 0);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    int64_t end = bt_now_ns() + 5000 * MS;
    while (atomic_load(&nfired) < 3 && bt_now_ns() < end) usleep(1000);
    bt_stop(F.tt); /* joins: the order array is complete */
    CHECK(atomic_load(&hook_mutex) == NULL); /* the hook ran */
    long pa = position(A_LABEL), pb = position(B_LABEL);
    printf("  buckets %d (A) and %d (B): A fired %s B\n", ba, bb,
           pa >= 0 && pb >= 0 ? (pa < pb ? "before" : "AFTER") : "?? (one did not fire)");
    CHECK(pa >= 0 && pb >= 0);
    CHECK(pa < pb);
    bt_destroy(F.tt);
}

/* ---- a due timer does not wait behind a long batch ------------------------- */

/* The first timer of a batch of 20 000 due native timers schedules one more,
 * due even earlier than the batch.  The timer thread must see it within a
 * few dozen timers (brpc's pull_again), not after the whole batch.  (An
 * earlier core fired it after all 20 000.) */

static bt_timer_thread *pull_tt;
static int64_t pull_deadline;

static void first_of_batch(void *arg, uint64_t id) {
    note(arg, id);
    uint64_t late;
    CHECK(bt_schedule_native(pull_tt, pull_deadline - 1, note, (void *)TRIGGER, &late) == 0);
}

static void test_due_timer_does_not_wait_behind_a_batch(void) {
    enum { N = 20000 };
    atomic_store(&nfired, 0);
    CHECK(bt_create(NULL, &pull_tt) == 0);
    pull_deadline = bt_now_ns() + 20 * MS;
    uint64_t id;
    CHECK(bt_schedule_native(pull_tt, pull_deadline, first_of_batch, (void *)A_LABEL, &id) == 0);
    for (int i = 1; i < N; i++)
        CHECK(bt_schedule_native(pull_tt, pull_deadline, note, (void *)B_LABEL, &id) == 0);
    int64_t end = bt_now_ns() + 10000 * MS;
    while (atomic_load(&nfired) < N + 1 && bt_now_ns() < end) usleep(1000);
    bt_stop(pull_tt);
    long p = position(TRIGGER);
    printf("  a due timer scheduled by the first of %d fired at position %ld\n", N, p);
    CHECK(p > 0 && p <= 1 + 64 + 1);
    CHECK(atomic_load(&nfired) == N + 1);
    bt_destroy(pull_tt);
}

/* The same for a batch of port timers, whose staging runs no callback: the
 * pass looks at the signal counter every 64 of them.  A native timer opens
 * the batch and lets a thread of ours schedule a timer due even earlier; it
 * must fire in the same pass, after some of the port timers and before the
 * last (without the look it would wait for all of them).
 *
 * How long the batch must be, and how far ahead its deadline, depend on the
 * machine's speed (an emulated CPU schedules and stages tens of times slower
 * than a native one, while sleeps and thread wake-ups take wall-clock time).
 * So each try that proves nothing says why, and the next one adapts: a
 * batch that fell due before all of it was scheduled gets a deadline further
 * ahead, from the measured scheduling time; a pass that ended before the
 * trigger was scheduled gets a longer batch; a schedule that came before the
 * look that follows the opening callback (0 port timers before it) is made
 * again. */

static _Atomic int batch_open;
static _Atomic uint64_t passes_in_batch, posted_before_trigger;

static void opens_the_batch(void *arg, uint64_t id) {
    note(arg, id);
    bt_stats s;
    bt_get_stats(pull_tt, &s);
    atomic_store(&passes_in_batch, s.passes); /* bumped when this pass ends */
    atomic_store(&batch_open, 1);
}

static void trigger_in_batch(void *arg, uint64_t id) {
    note(arg, id);
    bt_stats s;
    bt_get_stats(pull_tt, &s); /* the pass published what it staged before */
    atomic_store(&posted_before_trigger, s.posted);
}

static void *schedule_mid_batch(void *arg) {
    test_thread = 1;
    while (!atomic_load(&batch_open)) sched_yield();
    usleep(2000); /* past the look that follows the opening callback */
    uint64_t id;
    CHECK(bt_schedule_native(pull_tt, pull_deadline - 1, trigger_in_batch, (void *)TRIGGER,
                             &id) == 0);
    bt_stats s;
    bt_get_stats(pull_tt, &s);
    *(int *)arg = s.passes == atomic_load(&passes_in_batch); /* the pass was still on */
    return NULL;
}

/* What one try showed. */
enum batch_try { PROVED, OPENED_EARLY, PASS_ENDED, TOO_SOON };

/* One try with a batch of n port timers due lead_ns after it starts being
 * scheduled; *scheduling_ns is how long scheduling them took. */
static enum batch_try port_batch_try(int n, int64_t lead_ns, uint64_t *posted_before,
                                     int64_t *scheduling_ns) {
    atomic_store(&nfired, 0);
    atomic_store(&batch_open, 0);
    atomic_store(&posted_before_trigger, UINT64_MAX);
    CHECK(bt_create(NULL, &pull_tt) == 0);
    bt_port *p;
    CHECK(bt_port_open(pull_tt, 0, &p) == 0);
    int64_t start = bt_now_ns();
    pull_deadline = start + lead_ns;
    uint64_t id;
    CHECK(bt_schedule_native(pull_tt, pull_deadline, opens_the_batch, (void *)A_LABEL, &id) == 0);
    for (int i = 0; i < n; i++)
        CHECK(bt_schedule_port(pull_tt, pull_deadline, p, NULL, &id) == 0);
    *scheduling_ns = bt_now_ns() - start;
    int opened_early = atomic_load(&batch_open);
    int mid_pass = 0;
    pthread_t th;
    CHECK(pthread_create(&th, NULL, schedule_mid_batch, &mid_pass) == 0);
    pthread_join(th, NULL);
    /* Generous: only a core that lost timers takes this long. */
    int64_t end = bt_now_ns() + 120000 * MS;
    bt_stats s;
    do {
        usleep(1000);
        bt_get_stats(pull_tt, &s);
    } while ((atomic_load(&nfired) < 2 || s.posted < (uint64_t)n) && bt_now_ns() < end);
    bt_stop(pull_tt);
    *posted_before = atomic_load(&posted_before_trigger);
    static uint64_t ids[4096];
    size_t drained = 0, k;
    while ((k = bt_port_drain_ids(p, ids, 4096)) > 0) drained += k;
    CHECK(drained == (size_t)n);
    CHECK(atomic_load(&nfired) == 2);
    bt_destroy(pull_tt);
    if (opened_early) return OPENED_EARLY;
    if (!mid_pass) return PASS_ENDED;
    return *posted_before == 0 ? TOO_SOON : PROVED;
}

static void test_due_timer_does_not_wait_behind_port_posts(void) {
    enum { MAX_TRIES = 12, MAX_N = 3200000 };
    int n = 400000, tries = 0;
    int64_t lead = 50 * MS, scheduling = 0;
    uint64_t before = 0;
    enum batch_try r;
    while ((r = port_batch_try(n, lead, &before, &scheduling)) != PROVED && ++tries < MAX_TRIES) {
        int next_n = r == PASS_ENDED && n < MAX_N ? 2 * n : n;
        /* Twice the measured scheduling time (for the next batch's size)
         * ahead, and never less than before. */
        int64_t need = 50 * MS + 2 * scheduling * (next_n / n);
        if (r == OPENED_EARLY || need > lead) lead = need > lead ? need : 2 * lead;
        n = next_n;
    }
    printf("  a due timer scheduled during a batch of %d port timers (due %lld ms ahead) fired "
           "after %llu of them (%d inconclusive tries)\n",
           n, (long long)(lead / MS), (unsigned long long)before, tries);
    CHECK(r == PROVED);
    CHECK(before > 0 && before < (uint64_t)n);
}

/* ---- main ------------------------------------------------------------------- */

/* ---- delivery on request (bt_deliver_due) ---------------------------------
 * A timer due while the thread is held (bt_test_hold: as if it waited for a
 * CPU) is in its port when bt_deliver_due returns: the caller ran the pass
 * itself.  A native timer due then is left to the thread, which runs it
 * once let go; a stop ends delivery. */

static _Atomic int native_ran;

static void native_note(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    atomic_store(&native_ran, 1);
}

/* Waits until tt's thread has run its first pass, after which it sleeps
 * until a schedule wakes it: a hold set from then on comes before its next
 * look at the hold (one set while a new thread is still on its way to its
 * first pass may come too late for it). */
static int first_pass_done(bt_timer_thread *tt, int64_t timeout_ns) {
    int64_t end = bt_now_ns() + timeout_ns;
    for (bt_stats s;; usleep(100)) {
        bt_get_stats(tt, &s);
        if (s.passes > 0) return 1;
        if (bt_now_ns() > end) return 0;
    }
}

static void test_deliver_due_runs_the_pass_itself(void) {
    bt_timer_thread *tt = threaded_core();
    bt_port *p = open_port(tt);
    int payload;
    uint64_t id, nid, got[2];
    CHECK(first_pass_done(tt, 5000 * MS)); /* (before any pass of ours is counted) */
    CHECK(bt_deliver_due(tt) == 0); /* nothing scheduled: at once */
    CHECK(bt_test_hold(tt, 1) == 0);
    CHECK(bt_schedule_native(tt, bt_now_ns(), native_note, NULL, &nid) == 0);
    CHECK(bt_schedule_port(tt, bt_now_ns() + 1 * MS, p, &payload, &id) == 0);
    usleep(5000);
    CHECK(!bt_port_has_posted(p)); /* due, but the thread is held */
    CHECK(bt_deliver_due(tt) == 0);
    CHECK(bt_port_has_posted(p));
    CHECK(bt_port_drain_ids(p, got, 2) == 1 && got[0] == id);
    CHECK(!atomic_load(&native_ran)); /* the thread's, still held */
    CHECK(bt_test_hold(tt, 0) == 0);
    _Atomic int *ran = &native_ran;
    CHECK(wait_flag(ran, 2000 * MS));
    /* far away: nothing due, nothing posted */
    CHECK(bt_schedule_port(tt, bt_now_ns() + 10000 * MS, p, &payload, &id) == 0);
    CHECK(bt_deliver_due(tt) == 0);
    CHECK(!bt_port_has_posted(p));
    CHECK(bt_stop(tt) == 0);
    CHECK(bt_deliver_due(tt) == -ESHUTDOWN);
    CHECK(bt_test_hold(tt, 1) == -ESHUTDOWN);
    CHECK(bt_drop_all(tt, NULL, NULL) == 1);
    CHECK(bt_destroy(tt) == 0);
}

/* bt_port_deliver_due asks the port's bound first: 0 (no pass) while none
 * of its timers can be due, 1 once one is, and then the timer is posted. */
static void test_port_deliver_due_bound(void) {
    bt_timer_thread *tt = threaded_core();
    bt_port *p = open_port(tt), *q = open_port(tt);
    int payload;
    uint64_t id, got[2];
    CHECK(bt_test_hold(tt, 1) == 0);
    int64_t now = bt_now_ns();
    CHECK(bt_port_deliver_due(p, now, 1) == 0); /* nothing scheduled */
    CHECK(bt_schedule_port(tt, now + 10 * MS, p, &payload, &id) == 0);
    CHECK(bt_port_deliver_due(p, now, 1) == 0); /* not due yet */
    CHECK(bt_port_deliver_due(q, now + 20 * MS, 1) == 0); /* q has none */
    CHECK(bt_port_deliver_due(p, now + 10 * MS - 1, 1) == 0);
    CHECK(bt_port_deliver_due(p, now + 10 * MS, 1) == 1); /* due: on the dot */
    CHECK(bt_port_drain_ids(p, got, 2) == 1 && got[0] == id);
    /* the bound rose with the pass: nothing more of p's is pending */
    CHECK(bt_port_deliver_due(p, now + 10 * MS, 1) == 0);
    CHECK(bt_stop(tt) == 0);
    CHECK(bt_destroy(tt) == 0);
}

/* What a port holds comes out in (deadline, seq) order, whatever the passes
 * that posted it: A, due first, is posted and waits (nobody drains); then B,
 * scheduled with an earlier deadline already past, is posted by a later
 * pass; the consumer takes B first.  Ties keep schedule order. */
static void test_port_order_across_passes(void) {
    bt_timer_thread *tt = threaded_core();
    bt_port *p = open_port(tt);
    int payload;
    uint64_t a, b, c, d, got[4];
    int64_t now = bt_now_ns();
    CHECK(bt_schedule_port(tt, now, p, &payload, &a) == 0);
    CHECK(bt_deliver_due(tt) == 0);
    CHECK(bt_port_has_posted(p));
    CHECK(bt_schedule_port(tt, now - 5 * MS, p, &payload, &b) == 0);
    CHECK(bt_schedule_port(tt, now, p, &payload, &c) == 0);
    CHECK(bt_schedule_port(tt, now - 5 * MS, p, &payload, &d) == 0);
    CHECK(bt_deliver_due(tt) == 0);
    CHECK(bt_port_drain_ids(p, got, 4) == 4);
    CHECK(got[0] == b && got[1] == d && got[2] == a && got[3] == c);
    CHECK(bt_stop(tt) == 0);
    CHECK(bt_destroy(tt) == 0);
}

int main(void) {
    test_thread = 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct test tests[] = {
        {"fifo_across_buckets", test_fifo_across_buckets},
        {"due_timer_does_not_wait_behind_a_batch", test_due_timer_does_not_wait_behind_a_batch},
        {"due_timer_does_not_wait_behind_port_posts",
         test_due_timer_does_not_wait_behind_port_posts},
        {"deliver_due_runs_the_pass_itself", test_deliver_due_runs_the_pass_itself},
        {"port_deliver_due_bound", test_port_deliver_due_bound},
        {"port_order_across_passes", test_port_order_across_passes},
    };
    return RUN_TESTS(tests);
}
