/*
 * test_port_cancel.c -- bt_port_cancel_all and bt_port_retire: a port that
 * goes away (its loop closed) takes its pending timers with it, so that
 * nothing they hold stays alive until their deadlines, and then its own
 * memory, freed by the next pass.  Each timer is counted once (rule 10 of
 * docs/design.rst: scheduled == ran + cancelled + dropped), whether the walk
 * or a fire wins it, and what a retired port ran stays counted.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "bucketimer.h"

#include "check.h"

#define MS 1000000LL

struct seen {
    int n;
    intptr_t sum; /* of the payloads */
    bt_port *port;
    int other_port; /* calls naming a port other than `port` */
};

static void on_drop(void *ctx, bt_port *port, void *payload) {
    struct seen *s = ctx;
    s->n++;
    s->sum += (intptr_t)payload;
    if (port != s->port) s->other_port++;
}

static int balanced(bt_timer_thread *tt) {
    bt_stats s;
    bt_get_stats(tt, &s);
    return s.scheduled == s.ran + s.cancelled + s.dropped;
}

static void native_noop(void *arg, uint64_t id) {
    (void)id;
    ++*(int *)arg;
}

/* Pending and posted timers of the port go; another port's and native ones
 * stay and run. */
static void test_cancels_only_that_ports_timers(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p, *q;
    CHECK(bt_port_open(tt, 1, &p) == 0);
    CHECK(bt_port_open(tt, 1, &q) == 0);
    uint64_t id;
    CHECK(bt_schedule_port(tt, 2000, p, (void *)1, &id) == 0); /* posted below */
    CHECK(bt_schedule_port(tt, 5000, p, (void *)2, &id) == 0);
    CHECK(bt_schedule_port(tt, 6000, p, (void *)4, &id) == 0);
    CHECK(bt_schedule_port(tt, 5000, q, (void *)8, &id) == 0);
    int native_ran = 0;
    CHECK(bt_schedule_native(tt, 5000, native_noop, &native_ran, &id) == 0);
    CHECK(bt_advance(tt, 2000) == 1);

    struct seen s = {0, 0, p, 0};
    CHECK(bt_port_cancel_all(p, on_drop, &s) == 3);
    CHECK(s.n == 3 && s.sum == 7 && s.other_port == 0);
    uint64_t out[4];
    CHECK(bt_port_drain_ids(p, out, 4) == 0); /* the posted one was cancelled */
    CHECK(bt_cancel(tt, id) == BT_CANCELLED); /* a cancel after the walk still works */
    CHECK(bt_schedule_native(tt, 5000, native_noop, &native_ran, &id) == 0);

    CHECK(bt_advance(tt, 7000) == 2); /* q's and the native one */
    CHECK(native_ran == 1);
    CHECK(bt_port_drain_ids(q, out, 4) == 1);
    CHECK(bt_port_cancel_all(p, on_drop, &s) == 0); /* nothing left */
    CHECK(s.n == 3);
    CHECK(balanced(tt));
    bt_stats st;
    bt_get_stats(tt, &st);
    CHECK(st.cancelled == 4 && st.ran == 2);
    bt_destroy(tt);
}

/* After a detach the port's later timers would go to the orphans; cancelled
 * first, none gets there, and the slots come back free. */
static void test_after_detach_nothing_reaches_the_orphans(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p = open_port(tt);
    uint64_t id;
    for (intptr_t i = 0; i < 2000; i++)
        CHECK(bt_schedule_port(tt, 2000 + i, p, (void *)i, &id) == 0);
    CHECK(bt_port_detach(p) == 0);
    struct seen s = {0, 0, p, 0};
    CHECK(bt_port_cancel_all(p, on_drop, &s) == 2000);
    CHECK(s.n == 2000 && s.sum == 1999 * 2000 / 2);
    CHECK(bt_advance(tt, 10000) == 0);
    uint64_t out[4];
    CHECK(bt_port_drain_ids(bt_orphans(tt), out, 4) == 0);
    CHECK(balanced(tt));
    bt_stats st;
    bt_get_stats(tt, &st);
    CHECK(st.slots_free + st.slots_retired == st.slots); /* reaped by the pass */
    bt_destroy(tt);
}

static void test_bad_input(void) {
    bt_timer_thread *tt = manual_core(1000);
    CHECK(bt_port_cancel_all(NULL, on_drop, NULL) == -EINVAL);
    CHECK(bt_port_cancel_all(bt_orphans(tt), on_drop, NULL) == -EINVAL);
    bt_port *p;
    CHECK(bt_port_open(tt, 0, &p) == 0);
    uint64_t id;
    CHECK(bt_schedule_port(tt, 2000, p, NULL, &id) == 0);
    CHECK(bt_port_cancel_all(p, NULL, NULL) == 1); /* no callback: just cancels */
    CHECK(balanced(tt));
    bt_destroy(tt);
}

/* Against the timer thread firing the same timers: each one is either
 * cancelled by the walk (and handed to on_drop) or posted and then run by
 * the consumer, never both, never neither.  TSan watches the races. */
static void test_races_the_timer_thread(void) {
    bt_timer_thread *tt = threaded_core();
    bt_port *p = open_port(tt);
    enum { N = 20000 };
    int64_t now = bt_now_ns();
    uint64_t id;
    for (int i = 0; i < N; i++)
        CHECK(bt_schedule_port(tt, now + (i % 2000) * 1000, p, (void *)1, &id) == 0);
    struct timespec ts = {0, 1 * MS};
    nanosleep(&ts, NULL); /* let the thread fire some */
    struct seen s = {0, 0, p, 0};
    int64_t cancelled = bt_port_cancel_all(p, on_drop, &s);
    CHECK(cancelled == s.n && s.other_port == 0);
    /* Whatever the thread posted before losing the rest is in the queue. */
    static uint64_t out[N];
    size_t ran = 0;
    for (int tries = 0; tries < 10000 && (int64_t)ran + s.n < N; tries++) {
        ran += bt_port_drain_ids(p, out, N);
        if ((int64_t)ran + s.n < N) nanosleep(&ts, NULL);
    }
    CHECK((int64_t)ran + s.n == N);
    CHECK(bt_stop(tt) == 0);
    CHECK(balanced(tt));
    bt_destroy(tt);
}

/* Retire refuses a port still in use; once its port is detached and drained
 * it takes it, the next pass frees it (ASan sees any later use), and what
 * the port ran stays in the stats. */
struct retire_in_pass {
    bt_port *port;
    int rc;
};

static void retire_in_pass(void *arg, uint64_t id) {
    (void)id;
    struct retire_in_pass *r = arg;
    r->rc = bt_port_retire(r->port);
}

static void test_retire_frees_the_port_and_keeps_counts(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p;
    CHECK(bt_port_open(tt, 1, &p) == 0);
    uint64_t id, out[4];
    CHECK(bt_schedule_port(tt, 2000, p, (void *)1, &id) == 0);
    CHECK(bt_schedule_port(tt, 3000, p, (void *)2, &id) == 0);
    CHECK(bt_schedule_port(tt, 9000, p, (void *)4, &id) == 0);
    CHECK(bt_advance(tt, 2000) == 1);
    CHECK(bt_port_drain_ids(p, out, 4) == 1); /* ran: counted by the port */
    CHECK(bt_advance(tt, 3000) == 1);         /* posted, not drained */
    CHECK(bt_port_retire(p) == -EBUSY);       /* not detached */
    CHECK(bt_port_detach(p) == 0);
    CHECK(bt_port_retire(p) == -EBUSY); /* still holds a posted timer */
    struct seen s = {0, 0, p, 0};
    CHECK(bt_port_cancel_all(p, on_drop, &s) == 2);
    CHECK(bt_port_drain_ids(p, out, 4) == 0); /* the posted one, released */
    CHECK(bt_port_retire(p) == 0);
    CHECK(bt_port_retire(bt_orphans(tt)) == -EINVAL);
    CHECK(bt_port_retire(NULL) == -EINVAL);
    bt_stats st;
    bt_get_stats(tt, &st);
    CHECK(st.ran == 1 && st.ports == 2); /* the orphan port's and p's: opened */
    CHECK(bt_advance(tt, 10000) == 0); /* (p was freed by its retire: no pass ran) */
    bt_get_stats(tt, &st);
    CHECK(st.ran == 1 && st.cancelled == 2);
    CHECK(balanced(tt));
    /* retired while a pass runs (by a native callback of it): left to the
     * next pass; one retired the same way before bt_destroy: freed there */
    struct retire_in_pass r = {0, 0};
    CHECK(bt_port_open(tt, 0, &r.port) == 0);
    CHECK(bt_port_detach(r.port) == 0);
    CHECK(bt_schedule_native(tt, 11000, retire_in_pass, &r, &id) == 0);
    CHECK(bt_advance(tt, 11000) == 1);
    CHECK(r.rc == 0);
    CHECK(bt_advance(tt, 12000) == 0); /* frees it */
    CHECK(bt_port_open(tt, 0, &r.port) == 0);
    CHECK(bt_port_detach(r.port) == 0);
    CHECK(bt_schedule_native(tt, 13000, retire_in_pass, &r, &id) == 0);
    CHECK(bt_advance(tt, 13000) == 1);
    CHECK(r.rc == 0);
    bt_destroy(tt);
}

/* Loops of a short life, one after another, while the timer thread fires
 * and posts their timers: each port opened, used, detached, drained and
 * retired.  Under ASan a pass that touched a freed port fails; the counts
 * balance. */
static void test_retire_races_the_timer_thread(void) {
    bt_timer_thread *tt = threaded_core();
    enum { LOOPS = 300, N = 20 };
    uint64_t id, out[N];
    struct timespec ts = {0, 50000};
    int64_t cancelled = 0, ran = 0;
    for (int l = 0; l < LOOPS; l++) {
        bt_port *p;
        CHECK(bt_port_open(tt, 1, &p) == 0);
        int64_t now = bt_now_ns();
        for (int i = 0; i < N; i++)
            CHECK(bt_schedule_port(tt, now + (i % 4) * 20000, p, (void *)1, &id) == 0);
        nanosleep(&ts, NULL); /* let the thread fire some */
        CHECK(bt_port_detach(p) == 0);
        struct seen s = {0, 0, p, 0};
        cancelled += bt_port_cancel_all(p, on_drop, &s);
        ran += (int64_t)bt_port_drain_ids(p, out, N);
        CHECK(bt_port_retire(p) == 0);
    }
    CHECK(ran + cancelled == LOOPS * N);
    CHECK(bt_stop(tt) == 0);
    bt_stats st;
    bt_get_stats(tt, &st);
    CHECK((int64_t)st.ran == ran && st.ports == LOOPS + 1);
    CHECK(balanced(tt));
    bt_destroy(tt);
}

int main(void) {
    struct test tests[] = {
        {"cancels_only_that_ports_timers", test_cancels_only_that_ports_timers},
        {"after_detach_nothing_reaches_the_orphans",
         test_after_detach_nothing_reaches_the_orphans},
        {"bad_input", test_bad_input},
        {"races_the_timer_thread", test_races_the_timer_thread},
        {"retire_frees_the_port_and_keeps_counts",
         test_retire_frees_the_port_and_keeps_counts},
        {"retire_races_the_timer_thread", test_retire_races_the_timer_thread},
    };
    return RUN_TESTS(tests);
}
