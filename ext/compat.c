/*
 * compat.c -- reads of CPython state.
 */
#include <pthread.h>

#include "module.h"

/* ---- the running loop ----------------------------------------------------
 * asyncio's C _get_running_loop on 3.11 calls getpid() on every call (a
 * syscall since glibc stopped caching it) to hide a parent's loop from a
 * forked child.  That is a third of a schedule+cancel pair.  On 3.11 we read
 * the same per-thread holder asyncio reads and compare its pid with one we
 * cache and refresh after fork().  3.12 keeps the loop itself
 * under the same key (no pid check); a dict lookup there is three times
 * cheaper than calling _get_running_loop.  3.13 moved it into the
 * thread state, in the word that follows the public PyThreadState
 * (_PyThreadStateImpl.asyncio_running_loop, which _asyncio reads and writes
 * directly).  We read that word only once it has been seen to hold exactly
 * what _get_running_loop() returned; until then, and for good if it ever
 * did not, we call the function.  (Free-threaded builds always call it.) */

#if PY_VERSION_HEX < 0x030C0000
#include <unistd.h>
typedef struct {
    PyObject_HEAD
    PyObject *rl_loop;
    pid_t rl_pid;
} running_loop_holder; /* _asynciomodule.c, 3.11 */

static _Atomic pid_t cached_pid;
static void refresh_pid(void) { atomic_store(&cached_pid, getpid()); }
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;
static void install_pid_cache(void) {
    refresh_pid();
    pthread_atfork(NULL, NULL, refresh_pid);
}
#endif

void running_loop_init(void) {
#if PY_VERSION_HEX < 0x030C0000
    pthread_once(&pid_once, install_pid_cache);
#endif
}

/* New reference to the running loop of this thread, or to None. */
PyObject *running_loop(core_state *st) {
#if PY_VERSION_HEX < 0x030C0000
    PyObject *d = PyThreadState_GetDict();
    if (d) {
        PyObject *holder = PyDict_GetItemWithError(d, st->str_running_loop_key);
        if (!holder) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        if (!st->holder_type &&
            strstr(Py_TYPE(holder)->tp_name, "_RunningLoopHolder") != NULL &&
            Py_TYPE(holder)->tp_basicsize == sizeof(running_loop_holder))
            st->holder_type = (PyTypeObject *)Py_NewRef(Py_TYPE(holder));
        if (Py_TYPE(holder) == st->holder_type) {
            running_loop_holder *h = (running_loop_holder *)holder;
            if (h->rl_pid != atomic_load_explicit(&cached_pid, memory_order_relaxed))
                Py_RETURN_NONE;
            return Py_NewRef(h->rl_loop);
        }
    }
#elif PY_VERSION_HEX < 0x030D0000
    PyObject *d = PyThreadState_GetDict();
    if (d) {
        PyObject *loop = PyDict_GetItemWithError(d, st->str_running_loop_key);
        if (loop) return Py_NewRef(loop);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
#elif PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
    PyObject **slot = (PyObject **)((char *)PyThreadState_Get() + sizeof(PyThreadState));
    if (st->tstate_loop_ok > 0) return Py_NewRef(*slot ? *slot : Py_None);
    PyObject *loop = PyObject_CallNoArgs(st->get_running_loop);
    if (loop && loop != Py_None && st->tstate_loop_ok == 0)
        st->tstate_loop_ok = *slot == loop ? 1 : -1;
    return loop;
#endif
    return PyObject_CallNoArgs(st->get_running_loop);
}

/* Raises StopIteration(value) the way `return value` ends a coroutine.
 *
 * From 3.12 the interpreter's SEND no longer uses am_send for objects other
 * than generators and coroutines: it calls tp_iternext and fetches the
 * value out of the StopIteration.  Making that exception (its args tuple,
 * __init__, the context bookkeeping of PyErr_SetObject) was a sixth of an
 * `async with timeout()`.  So one instance is kept and raised again as long
 * as nobody else holds it or its args and it has picked up no traceback,
 * context, cause or notes: SEND reads `value` and drops its reference at
 * once, so in the common case it is ours alone again before the next raise.
 * Its args tuple, ours alone too, is refilled in place, so that whoever
 * catches it sees what StopIteration(value) would show.  Whoever keeps it
 * (a debugger, sys.monitoring, an `except StopIteration as e`) keeps it
 * unchanged: we make a new one. */
PyObject *raise_stop_iteration(core_state *st, PyObject *value) {
#ifndef Py_GIL_DISABLED
    PyObject *e = st->stop_iteration;
    if (e) {
        PyBaseExceptionObject *b = (PyBaseExceptionObject *)e;
        if (Py_REFCNT(e) == 1 && !b->traceback && !b->context && !b->cause && !b->notes &&
            !b->suppress_context && b->args && PyTuple_CheckExact(b->args) &&
            Py_REFCNT(b->args) == 1 && PyTuple_GET_SIZE(b->args) == 1 &&
            Py_IS_TYPE(e, (PyTypeObject *)PyExc_StopIteration)) {
            PyObject *old = PyTuple_GET_ITEM(b->args, 0);
            PyTuple_SET_ITEM(b->args, 0, Py_NewRef(value));
            Py_DECREF(old);
            Py_XSETREF(((PyStopIterationObject *)e)->value, Py_NewRef(value));
            PyErr_SetRaisedException(Py_NewRef(e));
            return NULL;
        }
        Py_CLEAR(st->stop_iteration);
    }
    e = PyObject_CallOneArg(PyExc_StopIteration, value);
    if (!e) return NULL;
    st->stop_iteration = Py_NewRef(e);
    PyErr_SetRaisedException(e);
    return NULL;
#else
    PyObject *e = PyObject_CallOneArg(PyExc_StopIteration, value);
    if (!e) return NULL;
    PyErr_SetRaisedException(e);
    return NULL;
#endif
}

/* Drops the kept StopIteration's references to `value` if it still has
 * them and nobody else holds it (so that a Timeout is not kept alive by
 * it). */
void forget_stop_iteration(core_state *st, PyObject *value) {
#ifndef Py_GIL_DISABLED
    PyObject *e = st->stop_iteration;
    if (e && Py_REFCNT(e) == 1 && ((PyStopIterationObject *)e)->value == value) {
        PyObject *args = ((PyBaseExceptionObject *)e)->args;
        if (args && PyTuple_CheckExact(args) && Py_REFCNT(args) == 1 &&
            PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == value) {
            PyTuple_SET_ITEM(args, 0, Py_NewRef(Py_None));
            Py_DECREF(value);
            Py_SETREF(((PyStopIterationObject *)e)->value, Py_NewRef(Py_None));
        } else {
            Py_CLEAR(st->stop_iteration);
        }
    }
#else
    (void)st;
    (void)value;
#endif
}
