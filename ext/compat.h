/*
 * compat.h -- the one place bucketimer._core reads CPython's private state,
 * and the public-API spellings older versions lack.
 *
 * Each private read ("read" below) answers a question the public API also
 * answers, only faster.  A read is used
 *   1. only on the CPython versions it was checked against (a gate at
 *      compile time: a newer CPython builds without it),
 *   2. only once a self-check saw it give the public API's answer, and
 *   3. never when BUCKETIMER_PUBLIC_API=1 is in the environment at import
 *      (or a comma-separated list naming it: running_loop, current_task,
 *      stop_iteration, cr_await).
 * Until then, and for good once the two ever disagree, the public API
 * answers.  So a version newer than the last one checked runs slower, never
 * wrong.  docs/design.rst ("Reads of CPython internals") lists each read,
 * what it saves and how it fails safe; _core._compat_status() reports which
 * reads are in use.
 *
 * Free threading: every read is per thread or per immutable object, and its
 * state word is atomic; the reused StopIteration is compiled out there.
 */
#ifndef BT_EXT_COMPAT_H
#define BT_EXT_COMPAT_H

#include <Python.h>
#include <stdatomic.h>

/* ---- public API that 3.11 spells differently ---------------------------- */

#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_T_DOUBLE T_DOUBLE
#define Py_T_LONGLONG T_LONGLONG
#define Py_READONLY READONLY
static inline PyObject *PyErr_GetRaisedException(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t) return NULL;
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb) PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}
/* As 3.12's: NULL (nothing was raised) leaves no exception set.  Callers
 * save and restore "whatever is pending", which is often nothing: a port
 * lost to another thread's in open_port, say. */
static inline void PyErr_SetRaisedException(PyObject *exc) {
    if (!exc) {
        PyErr_Clear();
        return;
    }
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}
#endif

/* getattr(o, name) without raising AttributeError: 1 found (*out set), 0
 * not found, -1 error. */
static inline int optional_attr(PyObject *o, PyObject *name, PyObject **out) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(o, name, out);
#else
    *out = PyObject_GetAttr(o, name);
    if (*out) return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    return 0;
#endif
}

/* A new reference to the attribute `name` of the module `module`. */
PyObject *ext_import_attr(const char *module, const char *name);

/* ---- the reads ---------------------------------------------------------- */

/* What a read's state word holds. */
enum ext_read_state {
    EXT_READ_OFF_VERSION = -3, /* not on this CPython build: public API */
    EXT_READ_OFF_ENV = -2,     /* BUCKETIMER_PUBLIC_API=1: public API */
    EXT_READ_OFF_MISMATCH = -1, /* disagreed with the public API once: public API */
    EXT_READ_UNPROVEN = 0,     /* both asked, until the first telling answer */
    EXT_READ_PROVEN = 1        /* in use */
};

typedef struct ext_compat {
    /* the public API each read stands in for */
    PyObject *get_running_loop; /* asyncio.events._get_running_loop */
    PyObject *current_task;     /* asyncio.tasks.current_task */
    PyObject *str_cr_await;     /* "cr_await" */
    PyObject *str_time;         /* "time" */
    /* one state word per read */
    _Atomic int running_loop_read;
    _Atomic int current_task_read;
    _Atomic int stop_iteration_read;
    _Atomic int cr_await_read;
    _Atomic int loop_time_read;
    /* what the reads need */
    PyObject *running_loop_key;  /* 3.11: thread-state dict key */
    PyTypeObject *holder_type;   /* 3.11: _asyncio._RunningLoopHolder, once seen */
    PyObject *current_tasks;     /* 3.11-3.13: _asyncio's loop -> task dict */
    PyObject *stop_iteration;    /* the StopIteration raised again and again */
    getter cr_await_getter;      /* the coroutine type's cr_await getter */
} ext_compat;

/* Imports what the public twins need, runs the checks that need no running
 * loop, and applies the gates and BUCKETIMER_PUBLIC_API.  -1 on error. */
int ext_compat_init(ext_compat *c);
int ext_compat_traverse(ext_compat *c, visitproc visit, void *arg);
void ext_compat_clear(ext_compat *c);
/* {read name: "private" | "unproven" | "public: <why>"} */
PyObject *ext_compat_status(ext_compat *c);

/* The running loop of this thread (new reference), or None: what
 * asyncio._get_running_loop() returns. */
PyObject *ext_running_loop(ext_compat *c);
/* The current task of `loop`, the running loop of this thread (new
 * reference), or None: what asyncio.current_task(loop) returns. */
PyObject *ext_current_task(ext_compat *c, PyObject *loop);
/* Raises StopIteration(value), as `return value` ends a coroutine; returns
 * NULL. */
PyObject *ext_raise_stop_iteration(ext_compat *c, PyObject *value);
/* Lets go of `value` if the StopIteration kept for reuse still holds it. */
void ext_forget_stop_iteration(ext_compat *c, PyObject *value);
/* The kept StopIteration, if nobody else holds it, lets go of the last
 * value it carried (the cyclic GC's start: that value, the Timeout an
 * `async with` entered, say, would otherwise keep what it holds, a Task
 * and its loop, from being collected). */
void ext_release_stop_iteration(ext_compat *c);
/* coro.cr_await of a native coroutine (new reference). */
PyObject *ext_coro_await(ext_compat *c, PyObject *coro);
/* The function that loop.time is bound from, when it is a method bound to
 * `loop` (new reference); None when it is anything else (set on the
 * instance, say). */
PyObject *ext_loop_time_function(ext_compat *c, PyObject *loop);

#endif
