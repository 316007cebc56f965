/* meshgate guest ABI: host imports of module "meshgate".
 *
 * Every string or byte buffer is a (pointer, length) pair into the guest's
 * memory; results are written into a buffer the guest provides, so the host
 * never allocates inside the guest. See docs/guest-abi.md.
 */
#ifndef MESHGATE_H
#define MESHGATE_H

#include <stdint.h>

/* Error codes: every call returns one of these on failure (distinct negatives). */
#define MG_NOT_FOUND (-1)        /* no such key or function */
#define MG_BUFFER_TOO_SMALL (-2) /* reserved: kv_get/invoke/caller return the length instead */
#define MG_DENIED (-3)           /* the namespace may not do this */
#define MG_LIMIT (-4)            /* a limit was reached (1,000 publishes, depth 5, quota) */
#define MG_BAD_ARGUMENT (-5)     /* pointer out of bounds, non-UTF-8 name, bad level */
#define MG_INTERNAL (-6)         /* the host or the called function failed */

/* Log levels of mg_log. */
#define MG_LOG_DEBUG 0
#define MG_LOG_INFO 1
#define MG_LOG_WARN 2
#define MG_LOG_ERROR 3

#define MG_IMPORT(name) __attribute__((import_module("meshgate"), import_name(name)))

/* Publish data to a topic of this namespace: 0 or a negative error. */
MG_IMPORT("publish")
int32_t mg_publish(const char *topic, uint32_t topic_len, const void *data, uint32_t data_len);

/* Read a key. Returns the value's length; the value is written only if it
 * fits in out_cap (else call again with a buffer that big). MG_NOT_FOUND if
 * absent, other negatives on error. */
MG_IMPORT("kv_get")
int64_t mg_kv_get(const void *key, uint32_t key_len, void *out, uint32_t out_cap);

/* Write a key: 0 or a negative error. */
MG_IMPORT("kv_put")
int32_t mg_kv_put(const void *key, uint32_t key_len, const void *val, uint32_t val_len);

/* Delete a key: 0 or a negative error. */
MG_IMPORT("kv_delete")
int32_t mg_kv_delete(const void *key, uint32_t key_len);

/* Call another function of this namespace with `in` as its stdin; its
 * stdout comes back as with mg_kv_get. Depth <= 5, deeper is MG_LIMIT. */
MG_IMPORT("invoke")
int64_t mg_invoke(const char *name, uint32_t name_len, const void *in, uint32_t in_len,
                  void *out, uint32_t out_cap);

/* The caller as JSON (subject, namespace, request id, trigger), as mg_kv_get. */
MG_IMPORT("caller")
int64_t mg_caller(void *out, uint32_t out_cap);

/* A log line at a level (MG_LOG_*): 0. */
MG_IMPORT("log")
int32_t mg_log(int32_t level, const char *msg, uint32_t msg_len);

#endif /* MESHGATE_H */
