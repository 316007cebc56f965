/* counter: increments the KV key "count" and prints the new value. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meshgate.h"

int main(void) {
  static const char key[] = "count";
  char buf[32];
  long count = 0;
  int64_t n = mg_kv_get(key, sizeof key - 1, buf, sizeof buf - 1);
  if (n >= 0 && n < (int64_t)sizeof buf) {
    buf[n] = '\0';
    count = strtol(buf, NULL, 10);
  } else if (n != MG_NOT_FOUND) {
    fprintf(stderr, "kv_get failed: %lld\n", (long long)n);
    return 1;
  }
  count++;
  int len = snprintf(buf, sizeof buf, "%ld", count);
  int32_t rc = mg_kv_put(key, sizeof key - 1, buf, (uint32_t)len);
  if (rc != 0) {
    fprintf(stderr, "kv_put failed: %d\n", rc);
    return 1;
  }
  printf("%ld\n", count);
  return 0;
}
