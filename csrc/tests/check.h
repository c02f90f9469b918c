/*
 * check.h -- the C tests' assertion: CHECK(cond) reports a failed condition
 * with its place and counts it for the running test, and the test goes on.
 * The count is atomic: stress scenarios check from worker threads.
 */
#ifndef BT_TESTS_CHECK_H
#define BT_TESTS_CHECK_H

#include <stdatomic.h>
#include <stdio.h>

static _Atomic int checks_failed_in_test;
static int failures;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            atomic_fetch_add(&checks_failed_in_test, 1);                             \
        }                                                                            \
    } while (0)

#endif
