/*
 * schedule.c -- what every way of scheduling from Python shares
 * (TimerThread.call_later/call_at, the drop-in loop's schedulers, a
 * Timeout's expiry): the arguments, the time, the loop's port, and the
 * Handle handed to the core (the loop's port is timer_thread_type.c's
 * ext_port_for).  Runs on the caller's thread with the GIL held;
 * bt_schedule_port takes its bucket's lock inside the core, GIL held.
 * Every object these functions are given is the caller's reference, held
 * across the call: each runs Python code (a number's __float__ or __lt__,
 * the loop's __hash__ and is_closed(), the port's _attach, the GC).
 */
#include "module.h"

PyObject *ext_raise_errno(int rc, const char *what) {
    if (rc == -ENOMEM) return PyErr_NoMemory();
    if (rc == -ESHUTDOWN) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is closed");
        return NULL;
    }
    if (rc == -ECHILD) {
        PyErr_SetString(PyExc_RuntimeError,
                        "TimerThread was created in a parent process; its thread does not "
                        "exist after fork()");
        return NULL;
    }
    errno = -rc;
    PyErr_Format(PyExc_OSError, "%s failed: %s", what, strerror(-rc));
    return NULL;
}

/* ---- arguments ------------------------------------------------------------------ */

/* A number too large for a double (a huge int, a Fraction): +inf if it is
 * positive (forever), -inf if negative (at once).  If it cannot even say
 * its sign, the OverflowError stands: -1. */
static int beyond_double(PyObject *o, double *out) {
    PyObject *exc = PyErr_GetRaisedException();
    PyObject *zero = PyLong_FromLong(0);
    int neg = zero ? PyObject_RichCompareBool(o, zero, Py_LT) : -1;
    Py_XDECREF(zero);
    if (neg < 0) {
        PyErr_Clear();
        PyErr_SetRaisedException(exc);
        return -1;
    }
    Py_DECREF(exc);
    *out = neg ? -INFINITY : INFINITY;
    return 0;
}

static int is_real_number(PyObject *o) {
    PyNumberMethods *nb = Py_TYPE(o)->tp_as_number;
    return PyLong_Check(o) || PyFloat_Check(o) || (nb && (nb->nb_float || nb->nb_index));
}

int ext_type_error(const char *what, const char *be, PyObject *o) {
    PyObject *name = PyType_GetName(Py_TYPE(o));
    if (!name) return -1;
    PyErr_Format(PyExc_TypeError, "%s must be %s, not %U", what, be, name);
    Py_DECREF(name);
    return -1;
}

int ext_to_seconds(PyObject *o, const char *what, double *out) {
    double v;
    if (PyFloat_CheckExact(o)) {
        v = PyFloat_AS_DOUBLE(o);
    } else if (PyBool_Check(o) || !is_real_number(o)) {
        return ext_type_error(what, "a real number", o);
    } else {
        v = PyFloat_AsDouble(o);
        if (v == -1.0 && PyErr_Occurred() &&
            (!PyErr_ExceptionMatches(PyExc_OverflowError) || beyond_double(o, &v) < 0))
            return -1;
    }
    if (isnan(v)) {
        PyErr_Format(PyExc_ValueError, "%s must not be NaN", what);
        return -1;
    }
    *out = v;
    return 0;
}

int ext_one_arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *func,
                const char *name, PyObject **out) {
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nk == 1) {
        if (nargs == 1) {
            *out = args[0];
            return 0;
        }
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), name) == 0) {
            *out = args[0];
            return 0;
        }
        PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", func,
                     PyTuple_GET_ITEM(kwnames, 0));
        return -1;
    }
    if (nargs + nk == 0)
        PyErr_Format(PyExc_TypeError, "%s() missing 1 required positional argument: '%s'", func,
                     name);
    else
        PyErr_Format(PyExc_TypeError, "%s() takes 1 argument (%zd given)", func, nargs + nk);
    return -1;
}

/* The argument shape every call_later/call_at shares: (time, callback,
 * *args) and the keywords context= and, where `loop` is not NULL, loop=. */
int ext_parse_schedule_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                               int absolute, PyObject **loop, PyObject **context) {
    const char *name = absolute ? "call_at" : "call_later";
    if (nargs < 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes a %s and a callback", name,
                     absolute ? "deadline" : "delay");
        return -1;
    }
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (loop && PyUnicode_CompareWithASCIIString(k, "loop") == 0) *loop = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(k, "context") == 0) *context = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, k);
            return -1;
        }
    }
    return 0;
}

/* ---- the hand-over ------------------------------------------------------------- */

/* The callback and context, checked (a Timeout's expiry is its own). */
static int check_target(PyObject *cb, PyObject **context, int flags) {
    if (!(flags & EXT_SCHED_TIMEOUT) && !PyCallable_Check(cb)) {
        return ext_type_error("callback", "callable", cb);
    }
    if (*context == Py_None) *context = NULL;
    if (*context && !PyContext_CheckExact(*context)) {
        return ext_type_error("context", "a contextvars.Context", *context);
    }
    return 0;
}

PyObject *ext_schedule(TimerThreadObject *self, int absolute, double t, PyObject *cb,
                            PyObject *const *cbargs, Py_ssize_t ncbargs, PyObject *loop,
                            PyObject *context, int flags) {
    if (check_target(cb, &context, flags) < 0) return NULL;
    PortObject *port = ext_port_for(self, loop);
    if (!port) return NULL;
    int64_t deadline;
    double when;
    if (absolute) {
        deadline = bt_deadline_at(t);
        when = t;
    } else {
        int64_t now = bt_now_ns();
        deadline = bt_deadline_after(now, t);
        when = deadline == INT64_MAX ? INFINITY : (double)now / 1e9 + t;
    }
    HandleObject *h = ext_handle_new(self, port, when, cb, cbargs, ncbargs, context, flags);
    if (!h) return NULL;
    Py_INCREF(h); /* the slot's reference, handed over at schedule */
    int rc = bt_schedule_port(self->core, deadline, port->port, h, &h->id);
    if (rc) {
        ext_handle_abandon(h);
        return ext_raise_errno(rc, absolute ? "call_at" : "call_later");
    }
    ext_handle_hold(h);
    if (self->st->armed_hook) ext_note_armed(self->st, (PyObject *)h);
    return (PyObject *)h;
}
