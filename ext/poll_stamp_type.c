/*
 * poll_stamp_type.c -- a loop's poll, as the core sees it.  A PollStamp
 * wraps the loop's selector (the drop-in loop's from the start; a stock
 * selector loop's once bucketimer's timers go to it: _timers.py): its
 * select() calls the wrapped one, then reads the core's clock into
 * polled_ns and the core's next schedule order into each port's
 * polled_seq, which bound the port's drain (port_type.c), and runs the pass
 * for each port it watches whose timers may be due by then, so that they
 * run in this iteration, as asyncio runs what its heap holds due
 * (docs/design.rst, "Order on the loop").  _timers.py subclasses
 * it with the rest of the selector API, which is called far less often.  It
 * is C because select() runs once per loop iteration, timers or not: in
 * Python the wrapper cost an idle iteration about 6% of its time; with
 * nothing due, the look at each port is a few loads.
 */
#include "module.h"

#define EVENT_READ 1 /* selectors.EVENT_READ */

EXT_GC_TRAVERSE(PollStamp, PollStampObject, POLLSTAMP_REFS)
EXT_GC_CLEAR(PollStamp, PollStampObject, POLLSTAMP_REFS)

static void PollStamp_dealloc(PollStampObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    PollStamp_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *PollStamp_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *selector;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "PollStamp() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:PollStamp", &selector)) return NULL;
    ext_state *st = ext_state_of_type(type);
    return st ? ext_poll_stamp_new(st, type, selector) : NULL;
}

EXT_COLD PyObject *ext_poll_stamp_new(ext_state *st, PyTypeObject *type, PyObject *selector) {
    PyObject *select = PyObject_GetAttr(selector, st->str_select);
    if (!select) return NULL;
    if (!PyCallable_Check(select)) {
        Py_DECREF(select);
        return PyErr_Format(PyExc_TypeError, "selector.select must be callable, not %.100s",
                            Py_TYPE(select)->tp_name);
    }
    PollStampObject *self = (PollStampObject *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(select);
        return NULL;
    }
    self->ports = PyList_New(0);
    if (!self->ports) {
        Py_DECREF(select);
        Py_DECREF(self);
        return NULL;
    }
    self->selector = Py_NewRef(selector);
    self->select = select;
    self->polled_ns = -1;
    return (PyObject *)self;
}

/* 1 if the events a select() returned name `fd` (a SelectorKey is a named
 * tuple whose second item is the fd), 0 if not or if it cannot tell. */
static int names_fd(PyObject *ready, long fd) {
    if (!PyList_Check(ready)) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ready); i++) {
        PyObject *ev = PyList_GET_ITEM(ready, i);
        PyObject *key = PyTuple_Check(ev) && PyTuple_GET_SIZE(ev) >= 1 ? PyTuple_GET_ITEM(ev, 0) : NULL;
        PyObject *kfd = key && PyTuple_Check(key) && PyTuple_GET_SIZE(key) >= 2
                            ? PyTuple_GET_ITEM(key, 1)
                            : NULL;
        if (kfd && PyLong_CheckExact(kfd) && PyLong_AsLong(kfd) == fd) return 1;
    }
    return 0;
}

/* Adds (the port's key, EVENT_READ) to the list select() returned, as if
 * its eventfd had been readable then: the loop queues the port's reader
 * with this iteration's I/O callbacks.  An error is reported, not raised:
 * the poll itself went well, and the timers run at the next one. */
static void add_read_event(PollStampObject *self, PyObject *ready, long fd) {
    PyObject *selector = Py_XNewRef(self->selector);
    if (!selector) return; /* (cleared) */
    PyObject *key = PyObject_CallMethod(selector, "get_key", "l", fd);
    Py_DECREF(selector);
    PyObject *ev = key ? Py_BuildValue("(Ni)", key, EVENT_READ) : NULL;
    if (ev && PyList_Append(ready, ev) == 0) {
        Py_DECREF(ev);
        return;
    }
    Py_XDECREF(ev);
    /* KeyError: its reader is not added yet (it was attached from another
     * thread; its eventfd's next poll serves) */
    if (PyErr_ExceptionMatches(PyExc_KeyError)) PyErr_Clear();
    else PyErr_WriteUnraisable((PyObject *)self);
}

/* Appends the event that queues the port's drain (made once, by the
 * subclass's _wake_event) to a poll's events, last, for a port that wakes
 * its loop through the loop's self-pipe.  asyncio queues callbacks in the
 * order of the events, so the drain runs after the loop's own reader of the
 * self-pipe whenever that runs too: a wake the reader empties was sent by a
 * post this drain takes, and one sent after the drain's ack stays for the
 * next poll (docs/design.rst, "Waking a stock loop").  An error is
 * reported; the timers stay posted, and the next poll tries again. */
static void add_wake_event(PollStampObject *self, PyObject *ready, PortObject *p) {
    PyObject *ev = Py_XNewRef(p->wake_event);
    if (!ev) {
        ev = PyObject_CallMethod((PyObject *)self, "_wake_event", "O", (PyObject *)p);
        if (ev && !p->wake_event) p->wake_event = Py_NewRef(ev);
    }
    if (ev && PyList_Append(ready, ev) == 0) {
        Py_DECREF(ev);
        return;
    }
    Py_XDECREF(ev);
    PyErr_WriteUnraisable((PyObject *)self);
}

/* After a poll at `now`: each watched port's timers due by then are posted
 * (a pass on this thread if the timer thread has not), and a port that holds
 * posted timers its eventfd's event did not announce gets one; a port that
 * wakes the loop's self-pipe, also when the self-pipe's reader runs this
 * round.  Ports detached since are dropped from the list. */
static void deliver_due(PollStampObject *self, PyObject *ready, int64_t now) {
    PyObject *ports = Py_NewRef(self->ports);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ports); i++) {
        PortObject *p = (PortObject *)Py_NewRef(PyList_GET_ITEM(ports, i));
        long fd = p->tt ? (long)bt_port_fd(p->port) : -1;
        if (fd < 0) {
            if (PyList_SetSlice(ports, i, i + 1, NULL) == 0) i--;
            else PyErr_WriteUnraisable((PyObject *)self);
        } else {
            ext_port_deliver_due(p, now);
            /* (get_key runs Python code: the list is read again after it,
             * and p is held) */
            if (bt_port_has_posted(p->port)) {
                if (bt_port_wakes_socket(p->port)) add_wake_event(self, ready, p);
                else if (!names_fd(ready, fd)) add_read_event(self, ready, fd);
            } else if (bt_port_wakes_socket(p->port) && names_fd(ready, p->wake_peer)) {
                /* the reader empties the self-pipe this round: a post may
                 * land between this look and its read (add_wake_event) */
                add_wake_event(self, ready, p);
            }
        }
        Py_DECREF(p);
    }
    Py_DECREF(ports);
}

/* Each watched port's polled_seq: what its drain will leave for the next
 * iteration, having been scheduled after this poll. */
static void note_seq(PyObject *ports) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ports); i++) {
        PortObject *p = (PortObject *)PyList_GET_ITEM(ports, i);
        if (p->tt) p->polled_seq = bt_port_next_seq(p->port);
    }
}

static PyObject *PollStamp_select(PollStampObject *self, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
    PyObject *select = self->select;
    if (!select) {
        PyErr_SetString(PyExc_RuntimeError, "PollStamp has no selector (cleared)");
        return NULL;
    }
    /* the wrapped select runs Python, which could reach tp_clear */
    Py_INCREF(select);
    PyObject *ready = PyObject_Vectorcall(select, args, PyVectorcall_NARGS(nargsf), kwnames);
    Py_DECREF(select);
    if (!ready) return NULL;
    int64_t now = bt_now_ns();
    self->polled_ns = (long long)now;
    if (self->ports && PyList_GET_SIZE(self->ports)) {
        note_seq(self->ports);
        if (PyList_CheckExact(ready)) deliver_due(self, ready, now);
    }
    return ready;
}

/* _watch(port): the port's loop polls through this selector; the port's
 * drain is bounded by this poll, and the poll delivers its due timers. */
static PyObject *PollStamp_watch(PollStampObject *self, PyObject *port) {
    ext_state *st = ext_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    if (!PyObject_TypeCheck(port, st->Port_Type))
        return PyErr_Format(PyExc_TypeError, "_watch() takes a Port, not %.100s",
                            Py_TYPE(port)->tp_name);
    if (!self->ports) {
        PyErr_SetString(PyExc_RuntimeError, "PollStamp has no selector (cleared)");
        return NULL;
    }
    if (ext_poll_stamp_watch(self, (PortObject *)port) < 0) return NULL;
    Py_RETURN_NONE;
}

EXT_COLD int ext_poll_stamp_watch(PollStampObject *self, PortObject *p) {
    if (!self->ports) {
        PyErr_SetString(PyExc_RuntimeError, "PollStamp has no selector (cleared)");
        return -1;
    }
    if (p->stamp != self) {
        /* A stamp may begin mid-iteration (a stock loop's, at bucketimer's
         * first timer for it), after the poll it cannot have seen: the
         * bound is then now, and what the port is given from now on waits
         * for the next poll, as asyncio's heap keeps what a callback arms. */
        if (self->polled_ns < 0) self->polled_ns = (long long)bt_now_ns();
        p->polled_seq = p->tt ? bt_port_next_seq(p->port) : UINT64_MAX;
        Py_XSETREF(p->stamp, (PollStampObject *)Py_NewRef(self));
        if (PyList_Append(self->ports, (PyObject *)p) < 0) return -1;
    }
    return 0;
}

/* _close_ports(): each watched port's TimerThread detaches it
 * (TimerThread._loop_closing), as the loop's selector is about to close:
 * asyncio's loop.close() closes its selector last, once the loop refuses
 * callbacks and its self-pipe is closed (docs/design.rst, "Waking a stock
 * loop").  Stops at the first that raises. */
static PyObject *PollStamp_close_ports(PollStampObject *self, PyObject *Py_UNUSED(ignored)) {
    ext_state *st = ext_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    if (!self->ports) Py_RETURN_NONE;
    /* a copy: _loop_closing runs Python code, and a detach empties the list */
    PyObject *ports = PyList_GetSlice(self->ports, 0, PY_SSIZE_T_MAX);
    if (!ports) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ports); i++) {
        PortObject *p = (PortObject *)PyList_GET_ITEM(ports, i); /* held by the copy */
        PyObject *tt = Py_XNewRef((PyObject *)p->tt), *loop = Py_XNewRef(p->loop);
        PyObject *r = tt && loop && loop != Py_None
                          ? PyObject_CallMethodOneArg(tt, st->str_loop_closing, loop)
                          : Py_NewRef(Py_None);
        Py_XDECREF(tt);
        Py_XDECREF(loop);
        if (!r) {
            Py_DECREF(ports);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(ports);
    Py_RETURN_NONE;
}

static PyMethodDef PollStamp_methods[] = {
    {"select", (PyCFunction)(void (*)(void))PollStamp_select, METH_FASTCALL | METH_KEYWORDS,
     "select($self, /, timeout=None)\n--\n\n"
     "The wrapped selector's select(); then notes the time in polled_ns and delivers the "
     "watched ports' timers due by then."},
    {"_watch", (PyCFunction)PollStamp_watch, METH_O,
     "_watch($self, port, /)\n--\n\nThe loop of `port` polls through this selector."},
    {"_close_ports", (PyCFunction)PollStamp_close_ports, METH_NOARGS,
     "_close_ports($self, /)\n--\n\nThe watched ports' TimerThreads detach them: the "
     "selector is about to close."},
    {NULL}};

static PyMemberDef PollStamp_members[] = {
    {"selector", Py_T_OBJECT_EX, offsetof(PollStampObject, selector), Py_READONLY,
     "The wrapped selector."},
    {"polled_ns", Py_T_LONGLONG, offsetof(PollStampObject, polled_ns), Py_READONLY,
     "When the last select() returned: the core's clock (CLOCK_MONOTONIC) in ns; before "
     "the first, when it began watching a port, or -1."},
    {NULL}};

static PyType_Slot PollStamp_slots[] = {
    {Py_tp_doc, "PollStamp(selector, /)\n--\n\n"
                "A selector's select(), noting when each poll returned."},
    {Py_tp_new, PollStamp_new},
    {Py_tp_dealloc, PollStamp_dealloc},
    {Py_tp_traverse, PollStamp_traverse},
    {Py_tp_clear, PollStamp_clear},
    {Py_tp_methods, PollStamp_methods},
    {Py_tp_members, PollStamp_members},
    {0, NULL}};

PyType_Spec PollStamp_spec = {
    .name = "bucketimer._core.PollStamp",
    .basicsize = sizeof(PollStampObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_BASETYPE,
    .slots = PollStamp_slots,
};
