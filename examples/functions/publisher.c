/* publisher: publishes its input to the topic "events". */
#include <stdio.h>

#include "meshgate.h"

int main(void) {
  static char buf[1 << 20];
  static const char topic[] = "events";
  size_t n = fread(buf, 1, sizeof buf, stdin);
  int32_t rc = mg_publish(topic, sizeof topic - 1, buf, (uint32_t)n);
  if (rc != 0) {
    fprintf(stderr, "publish failed: %d\n", rc);
    return 1;
  }
  static const char msg[] = "published to events";
  mg_log(MG_LOG_INFO, msg, sizeof msg - 1);
  printf("{\"published\":%zu}\n", n);
  return 0;
}
