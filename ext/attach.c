/*
 * attach.c -- a stock loop's new port, connected in C.
 *
 * The first bucketimer timer that goes to a loop opens the loop's port
 * (timer_thread_type.c, open_port), and _timers.TimerThread._attach
 * connects it: the loop's error reporter, its selector's PollStamp (whose
 * close, the last step of asyncio's loop.close(), detaches the port) and the
 * port's wake.  In the usual case -- a timer armed inside the running loop,
 * a loop class that _timers has vetted once (_attach_class: asyncio's
 * selector loop in everything this reads), a TimerThread whose dispatcher
 * already audits its loops (_fast_attach) -- this does the same here, where
 * the Python method would cost a short-lived loop more than asyncio's own
 * first timer does (docs/design.rst, "Waking a stock loop").  It reads only;
 * once it has found everything it needs, it makes its changes; anything it
 * does not find leaves the port to _attach.
 */
#include "module.h"

#include <limits.h>

/* ---- the vetting of a loop class --------------------------------------------- */

/* How many verdicts are kept: a program has a loop class or two, a test
 * suite may make many (the cache is emptied when full, and holds them). */
#define VETTED_CLASSES_MAX 64

/* 1 if _timers vetted the class of `loop` for this path, 0 if not, -1 with
 * an exception.  The verdict is kept per class (a class's methods are not
 * expected to change once it has loops). */
static int class_vetted(ext_state *st, PyObject *loop) {
    PyObject *cls = (PyObject *)Py_TYPE(loop);
    PyObject *v = PyDict_GetItemWithError(st->attach_classes, cls); /* borrowed, used at once */
    if (v) return v == Py_True;
    if (PyErr_Occurred()) return -1;
    PyObject *vet = Py_NewRef(st->attach_class); /* (its call may replace it) */
    v = PyObject_CallOneArg(vet, cls);
    Py_DECREF(vet);
    if (!v) return -1;
    int ok = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (ok < 0) return -1;
    if (PyDict_GET_SIZE(st->attach_classes) >= VETTED_CLASSES_MAX) PyDict_Clear(st->attach_classes);
    if (PyDict_SetItem(st->attach_classes, cls, ok ? Py_True : Py_False) < 0) return -1;
    return ok;
}

/* The fd of `loop`'s socket attribute `name` (a socket.socket), or -1 if it
 * is none; -2 with an exception. */
EXT_COLD static long socket_fd(ext_state *st, PyObject *loop, PyObject *name) {
    PyObject *sock;
    if (optional_attr(loop, name, &sock) < 0) return -2;
    if (!sock) return -1;
    long fd = -1;
    if (st->socket_fileno && Py_IS_TYPE(sock, (PyTypeObject *)st->socket_type)) {
        /* (its class's own fileno: looked up once, by _set_attach) */
        PyObject *fileno = Py_NewRef(st->socket_fileno);
        PyObject *r = PyObject_CallOneArg(fileno, sock);
        Py_DECREF(fileno);
        fd = r ? PyLong_AsLong(r) : -2;
        Py_XDECREF(r);
        if (fd == -1 && PyErr_Occurred()) fd = -2;
        if (fd > INT_MAX) fd = -1;
    }
    Py_DECREF(sock);
    return fd;
}

/* ---- the attach ---------------------------------------------------------------- */

/* The loop whose constructor is opening its port in this thread
 * (ext_port_of_made): borrowed, and only compared while that call runs. */
static _Thread_local PyObject *made_loop;

int ext_loop_inside(ext_state *st, PyObject *loop) {
    if (!st->attach_class) return 0;
    if (loop == made_loop) return class_vetted(st, loop);
    PyObject *running = ext_running_loop(&st->compat);
    if (!running) return -1;
    Py_DECREF(running); /* (compared only) */
    return running == loop ? class_vetted(st, loop) : 0;
}

EXT_COLD int ext_attach_fast(TimerThreadObject *self, PyObject *loop, PortObject *port) {
    ext_state *st = self->st;
    if (!self->fast_attach || !st->stamp_class) return 0;
    int ok = ext_loop_inside(st, loop);
    if (ok <= 0) return ok;

    /* What it needs, read without changing anything. */
    long csock = socket_fd(st, loop, st->str_csock);
    if (csock == -2) return -1;
    long ssock = csock >= 0 ? socket_fd(st, loop, st->str_ssock) : -1;
    if (ssock == -2) return -1;
    if (csock < 0 || ssock < 0) return 0;
    PyObject *selector;
    if (optional_attr(loop, st->str_selector, &selector) < 0) return -1;
    if (!selector) return 0;
    int is_stamp = PyObject_TypeCheck(selector, (PyTypeObject *)st->stamp_class);
    if (!is_stamp && (PyObject *)Py_TYPE(selector) != st->selector_type) {
        /* (an ABC's isinstance costs a loop more than its first timer
         * should: the answer for the class is kept) */
        int wrappable = PyObject_IsInstance(selector, st->BaseSelector);
        if (wrappable <= 0) {
            Py_DECREF(selector);
            return wrappable;
        }
        Py_XSETREF(st->selector_type, Py_NewRef(Py_TYPE(selector)));
    }

    /* Its changes: the same as _attach's, in the same order. */
    int rc = -1;
    PyObject *stamp = NULL, *reporter = NULL;
    /* report_to_loop(loop, handle, exc), as _timers.loop_reporter makes it */
    reporter = PyMethod_New(st->report_to_loop, loop);
    if (!reporter) goto done;
    Py_XSETREF(port->on_error, reporter);
    if (is_stamp) {
        stamp = Py_NewRef(selector);
    } else {
        /* held: making the stamp reads selector.select, Python code that may
         * register another class */
        PyTypeObject *stamp_type = (PyTypeObject *)Py_NewRef(st->stamp_class);
        stamp = stamp_type->tp_init == PyBaseObject_Type.tp_init
                    ? ext_poll_stamp_new(st, stamp_type, selector)
                    : PyObject_CallOneArg((PyObject *)stamp_type, selector);
        Py_DECREF(stamp_type);
        if (!stamp) goto done;
        if (PyObject_SetAttr(loop, st->str_selector, stamp) < 0) goto done;
    }
    if (ext_poll_stamp_watch((PollStampObject *)stamp, port) < 0) goto done;
    int wrc = bt_port_wake_by(port->port, (int32_t)csock);
    if (wrc == -EINVAL) { /* detached: the loop's close ran meanwhile */
        PyErr_SetString(PyExc_RuntimeError, "cannot schedule on a closed event loop");
        goto done;
    }
    if (wrc) {
        ext_raise_errno(wrc, "wake_by");
        goto done;
    }
    port->wake_peer = ssock;
    rc = 1;
done:
    Py_XDECREF(stamp);
    Py_DECREF(selector);
    return rc;
}

PortObject *ext_port_of_made(TimerThreadObject *self, PyObject *loop) {
    PyObject *outer = made_loop; /* (a constructor that makes a loop) */
    made_loop = loop;
    PortObject *port = ext_port_for(self, loop);
    made_loop = outer;
    return port;
}

PyObject *ext_made_loop(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    return Py_NewRef(made_loop ? made_loop : Py_None);
}

/* _core._set_attach(attach_class, stamp_class, report_to_loop, socket,
 * BaseSelector): what ext_attach_fast calls and compares with,
 * registered by _timers as it is imported. */
PyObject *ext_set_attach(PyObject *m, PyObject *args) {
    ext_state *st = ext_state_of_module(m);
    PyObject *attach_class, *stamp_class, *report, *socket_type, *base_selector;
    if (!PyArg_ParseTuple(args, "OO!OO!O:_set_attach", &attach_class, &PyType_Type, &stamp_class,
                          &report, &PyType_Type, &socket_type, &base_selector))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)stamp_class, st->PollStamp_Type)) {
        PyErr_SetString(PyExc_TypeError, "stamp_class must be a PollStamp subclass");
        return NULL;
    }
    PyObject *fileno = PyObject_GetAttr(socket_type, st->str_fileno);
    if (!fileno) return NULL;
    PyObject *classes = PyDict_New();
    if (!classes) {
        Py_DECREF(fileno);
        return NULL;
    }
    Py_XSETREF(st->attach_classes, classes);
    Py_XSETREF(st->attach_class, Py_NewRef(attach_class));
    Py_XSETREF(st->stamp_class, Py_NewRef(stamp_class));
    Py_XSETREF(st->report_to_loop, Py_NewRef(report));
    Py_XSETREF(st->socket_type, Py_NewRef(socket_type));
    Py_XSETREF(st->socket_fileno, fileno);
    Py_XSETREF(st->BaseSelector, Py_NewRef(base_selector));
    Py_RETURN_NONE;
}
