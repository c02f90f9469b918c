/*
 * freelist.h -- dead objects of one type kept for the next allocation, so
 * that the hot paths (a Handle per call_later, a Timeout and two steps per
 * `async with timeout()`) neither allocate nor move the GC towards a
 * collection.  The GIL serialises put and take; a free-threaded build keeps
 * nothing and allocates every time.
 */
#ifndef BT_EXT_FREELIST_H
#define BT_EXT_FREELIST_H

#include <Python.h>

typedef struct {
    PyObject **items; /* storage for cap objects, owned by the module state */
    int n, cap;
    int gc;           /* the type has Py_TPFLAGS_HAVE_GC */
} ext_freelist;

static inline void ext_freelist_init(ext_freelist *fl, PyObject **storage, int cap, int gc) {
    fl->items = storage;
    fl->n = 0;
    fl->cap = cap;
    fl->gc = gc;
}

/* Called by a dealloc once the object let go of everything it held (and, for
 * a GC type, was untracked).  1: kept, and the type's reference dropped as
 * the dealloc would; 0: the caller frees it. */
static inline int ext_freelist_put(ext_freelist *fl, PyObject *o) {
#ifdef Py_GIL_DISABLED
    (void)fl;
    (void)o;
    return 0;
#else
    if (fl->n >= fl->cap) return 0;
    fl->items[fl->n++] = o;
    Py_DECREF(Py_TYPE(o));
    return 1;
#endif
}

/* A kept object, made a new `tp` object again (its fields are garbage), or
 * NULL if none is kept. */
static inline PyObject *ext_freelist_take(ext_freelist *fl, PyTypeObject *tp) {
    if (fl->n == 0) return NULL;
    return PyObject_Init(fl->items[--fl->n], tp);
}

/* Frees what is kept; the module state calls it before it lets go of the
 * types. */
static inline void ext_freelist_clear(ext_freelist *fl) {
    while (fl->n > 0) {
        PyObject *o = fl->items[--fl->n];
        if (fl->gc) PyObject_GC_Del(o);
        else PyObject_Free(o);
    }
}

#endif
