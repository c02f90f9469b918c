/*
 * test_postpone.c -- bt_postpone (docs/design.rst rule 12), run by ctest and
 * under ThreadSanitizer: what it answers, that a postponed timer fires at
 * its new deadline and never before, that resets leave no cancelled entry
 * behind, and a race of postpones, fires and cancels on a real timer thread
 * checked afterwards.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketimer.h"

#include "check.h"

#define US 1000LL
#define MS 1000000LL

static void count(void *arg, uint64_t id) {
    (void)id;
    atomic_fetch_add((_Atomic int *)arg, 1);
}

/* ---- what it answers, in manual-clock mode ---------------------------------------- */

static void test_postpone_moves_a_pending_timer_later(void) {
    bt_timer_thread *tt = manual_core(0);
    _Atomic int runs = 0;
    uint64_t id;
    CHECK(bt_schedule_native(tt, 100, count, &runs, &id) == 0);
    CHECK(bt_postpone(tt, id, 150) == BT_POSTPONED); /* still in its bucket list */
    CHECK(bt_advance(tt, 120) == 0);                 /* collected at its new key */
    CHECK(bt_postpone(tt, id, 300) == BT_POSTPONED); /* now in the heap */
    CHECK(bt_advance(tt, 299) == 0);
    CHECK(atomic_load(&runs) == 0);
    CHECK(bt_advance(tt, 300) == 1);
    CHECK(atomic_load(&runs) == 1);
    CHECK(bt_postpone(tt, id, 400) == BT_UNKNOWN); /* it ran: the id went stale */
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.postponed == 2);
    CHECK(s.cancelled == 0 && s.reaped == 0 && s.dead == 0); /* nothing left behind */
    CHECK(s.early_fires == 0);
    bt_destroy(tt);
}

static void test_postpone_refuses_earlier_and_unknown(void) {
    bt_timer_thread *tt = manual_core(0), *other = manual_core(0);
    _Atomic int runs = 0;
    uint64_t id, foreign;
    CHECK(bt_schedule_native(tt, 100, count, &runs, &id) == 0);
    CHECK(bt_schedule_native(other, 100, count, &runs, &foreign) == 0);
    CHECK(bt_postpone(tt, id, 99) == BT_EARLIER);
    CHECK(bt_postpone(tt, id, 100) == BT_POSTPONED); /* not earlier: fine */
    CHECK(bt_postpone(tt, foreign, 200) == BT_UNKNOWN);
    CHECK(bt_postpone(tt, 0, 200) == BT_UNKNOWN);
    CHECK(bt_postpone(tt, id + (1ull << 32), 200) == BT_UNKNOWN); /* another generation */
    CHECK(bt_advance(tt, 100) == 1); /* unchanged by the refusals */
    CHECK(bt_postpone(tt, id, 200) == BT_UNKNOWN);
    uint64_t c;
    CHECK(bt_schedule_native(tt, 500, count, &runs, &c) == 0);
    CHECK(bt_cancel(tt, c) == BT_CANCELLED);
    CHECK(bt_postpone(tt, c, 600) == BT_TOO_LATE);
    CHECK(bt_advance(tt, 1000) == 0);
    CHECK(atomic_load(&runs) == 1);
    bt_destroy(tt);
    bt_destroy(other);
}

/* The answer compares with the timer's current deadline, the last
 * postpone's when the pass has not applied it yet: postpone(30) then
 * postpone(20) on a timer at 10 answers BT_EARLIER whether or not a pass
 * came in between, and the timer runs at 30.  (An earlier core compared
 * with the key the pass had last applied: before the pass it answered
 * BT_POSTPONED and moved the timer back to 20.) */
static int postpone_twice(int pass_between, int64_t *ran_at) {
    bt_timer_thread *tt = manual_core(0);
    _Atomic int runs = 0;
    uint64_t id;
    CHECK(bt_schedule_native(tt, 10, count, &runs, &id) == 0);
    CHECK(bt_postpone(tt, id, 30) == BT_POSTPONED);
    if (pass_between) CHECK(bt_advance(tt, 5) == 0); /* applies the move */
    int second = bt_postpone(tt, id, 20);
    *ran_at = -1;
    for (int64_t now = 6; now <= 40 && *ran_at < 0; now++)
        if (bt_advance(tt, now) == 1) *ran_at = now;
    bt_destroy(tt);
    return second;
}

static void test_postpone_answer_does_not_depend_on_the_pass(void) {
    int64_t ran_before, ran_after;
    int before = postpone_twice(0, &ran_before), after = postpone_twice(1, &ran_after);
    printf("  postpone(30) then postpone(20) on a timer at 10: %s a pass in between it "
           "answers %d and runs at %lld; %s, %d and %lld\n", "without", before,
           (long long)ran_before, "with", after, (long long)ran_after);
    CHECK(before == BT_EARLIER && after == BT_EARLIER);
    CHECK(ran_before == 30 && ran_after == 30);
}

/* A cancel after a postpone wins, and the slot comes back. */
static void test_cancel_after_postpone(void) {
    bt_timer_thread *tt = manual_core(0);
    _Atomic int runs = 0;
    uint64_t id;
    CHECK(bt_schedule_native(tt, 100, count, &runs, &id) == 0);
    CHECK(bt_advance(tt, 10) == 0);
    CHECK(bt_postpone(tt, id, 200) == BT_POSTPONED);
    CHECK(bt_cancel(tt, id) == BT_CANCELLED);
    CHECK(bt_advance(tt, 1000) == 0);
    CHECK(atomic_load(&runs) == 0);
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.dead == 0 && s.heap_size == 0 && s.slots_free == s.slots);
    bt_destroy(tt);
}

/* An idle timeout reset on every message: the heap keeps one entry. */
static void test_many_resets_leave_one_entry(void) {
    bt_timer_thread *tt = manual_core(0);
    _Atomic int runs = 0;
    uint64_t id;
    CHECK(bt_schedule_native(tt, 1000, count, &runs, &id) == 0);
    for (int64_t now = 0; now < 100000; now += 10) {
        CHECK(bt_advance(tt, now) == 0);
        CHECK(bt_postpone(tt, id, now + 1000) == BT_POSTPONED);
    }
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.heap_size + s.list_size == 1);
    CHECK(s.dead == 0 && s.slots - s.slots_free == 1);
    CHECK(bt_advance(tt, 100000 + 989) == 0);
    CHECK(bt_advance(tt, 100000 + 990) == 1);
    CHECK(atomic_load(&runs) == 1);
    bt_destroy(tt);
}

/* Equal deadlines: a postponed timer keeps its first schedule's place. */
static struct {
    _Atomic int n;
    int seen[4];
} order_rec;

static void note_a(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    order_rec.seen[atomic_fetch_add(&order_rec.n, 1)] = 'A';
}
static void note_b(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    order_rec.seen[atomic_fetch_add(&order_rec.n, 1)] = 'B';
}

static void test_postponed_timer_keeps_its_place_among_equals(void) {
    bt_timer_thread *tt = manual_core(0);
    memset(&order_rec, 0, sizeof(order_rec));
    uint64_t a, b;
    CHECK(bt_schedule_native(tt, 100, note_a, NULL, &a) == 0);
    CHECK(bt_advance(tt, 1) == 0);
    CHECK(bt_schedule_native(tt, 200, note_b, NULL, &b) == 0);
    CHECK(bt_postpone(tt, a, 200) == BT_POSTPONED);
    CHECK(bt_advance(tt, 200) == 2);
    CHECK(atomic_load(&order_rec.n) == 2);
    CHECK(order_rec.seen[0] == 'A' && order_rec.seen[1] == 'B');
    bt_destroy(tt);
}

/* ---- the race, on a real timer thread ------------------------------------------- */

#define RACERS 3
#define PER_RACER 400

struct racer_timer {
    _Atomic uint64_t id;
    _Atomic int runs;
    _Atomic int64_t ran_at;
    _Atomic int64_t max_postponed; /* the latest deadline a postpone won with */
    _Atomic int cancel_won;
};

static struct racer_timer timers[RACERS][PER_RACER];
static bt_timer_thread *race_tt;
static _Atomic uint64_t postpones_won;
static pthread_barrier_t barrier;

static void ran(void *arg, uint64_t id) {
    struct racer_timer *r = arg;
    (void)id;
    atomic_store(&r->ran_at, bt_now_ns());
    atomic_fetch_add(&r->runs, 1);
}

/* Each racer owns its timers: it schedules each a little ahead, then keeps
 * postponing them by small steps (racing the fire), and cancels some. */
static void *racer(void *arg) {
    struct racer_timer *mine = timers[(intptr_t)arg];
    pthread_barrier_wait(&barrier);
    for (int i = 0; i < PER_RACER; i++) {
        uint64_t id;
        int64_t d = bt_now_ns() + 200 * US;
        if (bt_schedule_native(race_tt, d, ran, &mine[i], &id) != 0) continue;
        atomic_store(&mine[i].id, id);
        for (int k = 0; k < 20; k++) {
            d += 20 * US;
            int rc = bt_postpone(race_tt, id, d);
            if (rc == BT_POSTPONED) {
                atomic_store(&mine[i].max_postponed, d);
                atomic_fetch_add(&postpones_won, 1);
            } else {
                /* fired: posted or running, or done and its id stale */
                CHECK(rc == BT_TOO_LATE || rc == BT_UNKNOWN);
                break;
            }
            if (k == 10 && i % 7 == 0) {
                int c = bt_cancel(race_tt, id);
                if (c == BT_CANCELLED) atomic_store(&mine[i].cancel_won, 1);
                break;
            }
            usleep(5);
        }
    }
    return NULL;
}

static void test_postpone_races_fire_and_cancel(void) {
    bt_options o;
    bt_options_init(&o);
    CHECK(bt_create(&o, &race_tt) == 0);
    memset(timers, 0, sizeof(timers));
    atomic_store(&postpones_won, 0);
    pthread_barrier_init(&barrier, NULL, RACERS);
    pthread_t th[RACERS];
    for (intptr_t i = 0; i < RACERS; i++) pthread_create(&th[i], NULL, racer, (void *)i);
    for (int i = 0; i < RACERS; i++) pthread_join(th[i], NULL);
    /* let everything due fire */
    int64_t end = bt_now_ns() + 5000 * MS;
    bt_stats s;
    for (;;) {
        bt_get_stats(race_tt, &s);
        if (s.ran + s.cancelled == s.scheduled || bt_now_ns() > end) break;
        usleep(1000);
    }
    CHECK(s.ran + s.cancelled == s.scheduled);
    CHECK(s.early_fires == 0);
    CHECK(s.postponed == atomic_load(&postpones_won));
    for (int r = 0; r < RACERS; r++) {
        for (int i = 0; i < PER_RACER; i++) {
            struct racer_timer *t = &timers[r][i];
            int runs = atomic_load(&t->runs), won = atomic_load(&t->cancel_won);
            CHECK(runs + won == 1); /* exactly once, or cancelled */
            /* Every postpone that won came before the fire: never early. */
            if (runs) CHECK(atomic_load(&t->ran_at) >= atomic_load(&t->max_postponed));
        }
    }
    bt_stop(race_tt);
    bt_destroy(race_tt);
    pthread_barrier_destroy(&barrier);
}

int main(void) {
    struct test tests[] = {
        {"postpone_moves_a_pending_timer_later", test_postpone_moves_a_pending_timer_later},
        {"postpone_refuses_earlier_and_unknown", test_postpone_refuses_earlier_and_unknown},
        {"cancel_after_postpone", test_cancel_after_postpone},
        {"postpone_answer_does_not_depend_on_the_pass",
         test_postpone_answer_does_not_depend_on_the_pass},
        {"many_resets_leave_one_entry", test_many_resets_leave_one_entry},
        {"postponed_timer_keeps_its_place_among_equals",
         test_postponed_timer_keeps_its_place_among_equals},
        {"postpone_races_fire_and_cancel", test_postpone_races_fire_and_cancel},
    };
    return RUN_TESTS(tests);
}
